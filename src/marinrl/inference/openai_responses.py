"""What the OpenAI routes answer: each sample cut by OpenAI's stop rule (`Finished`), then built into a
`Completion` or a `ChatCompletion` with the token ids beside the text, in vLLM's convention: `prompt_token_ids`
(chat: on the response; completions: on each choice) and `token_ids` on each choice, aligned one to one with the
choice's logprobs, so that agent code's calls can be trained on without re-tokenizing text.

`finish_reason` is "length" when `max_tokens` ran out and "stop" on EOS or a stop string; each stop string works
on its own, and the returned text ends before it.
"""

from __future__ import annotations

import time
import uuid
from typing import Optional, Sequence

from openai.types import Completion, CompletionChoice, CompletionUsage
from openai.types.chat import ChatCompletion, ChatCompletionMessage, ChatCompletionTokenLogprob
from openai.types.chat.chat_completion import Choice as ChatChoice
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.completion_choice import Logprobs

from marinrl.inference.context import Generation


class Finished:
    """One choice after OpenAI's stop rules: text ends before the first stop string."""

    def __init__(self, tokenizer, sample: Generation, stop_strings: Sequence[str]):
        tokens = [int(t) for t in sample.tokens]
        logprobs = [float(x) for x in sample.logprobs]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        cuts = [text.find(s) for s in stop_strings if s in text]
        finish = sample.finish_reason
        if cuts:
            # the shortest token prefix whose text holds a stop string ("contains" grows with the prefix)
            lo, hi = 1, len(tokens)
            while lo < hi:
                mid = (lo + hi) // 2
                part = tokenizer.decode(tokens[:mid], skip_special_tokens=True)
                if any(s in part for s in stop_strings):
                    hi = mid
                else:
                    lo = mid + 1
            tokens, logprobs, text, finish = tokens[:lo], logprobs[:lo], text[: min(cuts)], "stop"
        self.tokens, self.logprobs, self.text, self.finish_reason = tokens, logprobs, text, finish


def token_choices(tokenizer, samples: Sequence[Generation], stops: Sequence[str]
                  ) -> list[tuple[list[int], list[float], str, Optional[list[int]]]]:
    """The token route's choices (`token_endpoint.response_body`): token ids, logprobs, finish_reason and the
    weight step of each token kept."""
    choices = []
    for sample in samples:
        done = Finished(tokenizer, sample, stops)
        steps = sample.weight_steps
        steps = None if steps is None else [int(w) for w in steps[:len(done.tokens)]]
        choices.append((done.tokens, done.logprobs, done.finish_reason, steps))
    return choices


def completion(tokenizer, model_name: str, prompts: Sequence[Sequence[int]],
               results: Sequence[Sequence[Generation]], stops: Sequence[str], *, logprobs: bool) -> Completion:
    """The `/v1/completions` answer: every prompt's samples as choices, in order."""
    choices, n_out = [], 0
    for prompt, samples in zip(prompts, results):
        for sample in samples:
            done = Finished(tokenizer, sample, stops)
            choice_logprobs = None
            if logprobs:
                choice_logprobs = Logprobs(tokens=tokenizer.convert_ids_to_tokens(done.tokens),
                                           token_logprobs=[float(x) for x in done.logprobs])
            choices.append(CompletionChoice(
                index=len(choices), text=done.text, finish_reason=done.finish_reason, logprobs=choice_logprobs,
                prompt_token_ids=[int(t) for t in prompt], token_ids=done.tokens,
            ))
            n_out += len(done.tokens)
    n_in = sum(len(p) for p in prompts)
    return Completion(
        id=f"cmpl-{uuid.uuid4().hex}",
        object="text_completion",
        created=int(time.time()),
        model=model_name,
        choices=choices,
        usage=CompletionUsage(prompt_tokens=n_in, completion_tokens=n_out, total_tokens=n_in + n_out),
    )


def chat_completion(tokenizer, model_name: str, prompt: list[int], samples: Sequence[Generation],
                    stops: Sequence[str], *, logprobs: bool) -> ChatCompletion:
    """The `/v1/chat/completions` answer: one assistant message per sample."""
    choices, n_out = [], 0
    for sample in samples:
        done = Finished(tokenizer, sample, stops)
        choice_logprobs = None
        if logprobs:
            choice_logprobs = ChoiceLogprobs(content=[
                ChatCompletionTokenLogprob(token=tok, logprob=float(lp), bytes=list(tok.encode("utf-8")),
                                           top_logprobs=[])
                for tok, lp in zip(tokenizer.convert_ids_to_tokens(done.tokens), done.logprobs)
            ])
        choices.append(ChatChoice(
            index=len(choices),
            message=ChatCompletionMessage(role="assistant", content=done.text),
            finish_reason=done.finish_reason,
            logprobs=choice_logprobs,
            token_ids=done.tokens,
        ))
        n_out += len(done.tokens)
    return ChatCompletion(
        prompt_token_ids=prompt,
        id=f"chatcmpl-{uuid.uuid4().hex}",
        object="chat.completion",
        created=int(time.time()),
        model=model_name,
        choices=choices,
        usage=CompletionUsage(prompt_tokens=len(prompt), completion_tokens=n_out, total_tokens=len(prompt) + n_out),
    )
