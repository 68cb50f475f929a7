"""A single-turn verifiers environment: `c?` asks for the letter `c`; reward 1 for a reply that is
that letter, with a per-function score for a reply of one character. The harness runs in process: one
chat completion through the rollout's interception endpoint."""

import openai
import verifiers.v1 as vf

LETTERS = "abcd"


class LetterData(vf.TaskData):
    answer: str = ""


class LetterTask(vf.Task[LetterData]):
    @vf.reward
    async def correct(self, trace) -> float:
        return float(trace.last_reply.strip() == self.data.answer)

    @vf.metric
    async def one_char(self, trace) -> float:
        return float(len(trace.last_reply) == 1)


class LetterTaskset(vf.Taskset[LetterTask]):
    def load(self):
        for i in range(64):
            c = LETTERS[i % len(LETTERS)]
            yield LetterTask(LetterData(prompt=f"{c}?", answer=c, name=c), self.config.task)


class LetterHarness(vf.Harness[vf.HarnessConfig]):
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs):
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret)
        try:
            await client.chat.completions.create(model=ctx.model,
                                                 messages=[{"role": "user", "content": data.prompt}])
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["LetterTaskset", "LetterHarness"]
