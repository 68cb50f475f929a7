"""A two-player textarena game written against textarena's public API (`textarena.Env`,
`TwoPlayerState`), for the textarena adapter's job tests (tests/test_textarena.py): every action is
valid, so both players of a tiny random model take turns and both of their policies get rollouts."""

from __future__ import annotations

from typing import Optional

import textarena as ta


class HighCard(ta.Env):
    """Each player names one character; the higher first byte wins (1 / -1), equal bytes draw (0).
    Player 0 moves first, then player 1; the game ends after both have moved."""

    def reset(self, num_players: int, seed: Optional[int] = None):
        self.state = ta.TwoPlayerState(num_players=num_players, seed=seed)
        self.state.reset(game_state={"cards": {}}, player_prompt_function=lambda player_id, game_state: "card?")

    def step(self, action: str):
        player = self.state.current_player_id
        self.state.add_observation(from_id=player, message=action, observation_type=ta.ObservationType.PLAYER_ACTION)
        cards = self.state.game_state["cards"]
        cards[player] = action.encode("utf-8", "replace")[:1] or b"\x00"
        if len(cards) == 2:
            if cards[0] == cards[1]:
                self.state.set_draw(reason="same card")
            else:
                self.state.set_winner(player_id=0 if cards[0] > cards[1] else 1, reason="higher card")
        return self.state.step()
