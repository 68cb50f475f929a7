"""A multi-turn tool environment: `3+1=` asks for the sum; the model may call the calculator with a reply that
starts with `@`, and the harness answers in the conversation with the tool's result (`=4`), then asks again, up
to three model turns. Rewards: `correct` (the last reply is the sum) and `used_tool` (weight 0.2). The tool's
answers are environment tokens: verifiers' sampled mask keeps them out of training."""

import openai
import verifiers.v1 as vf

MAX_TURNS = 3


class CalcData(vf.TaskData):
    a: int = 0
    b: int = 0


class CalcTask(vf.Task):
    @vf.reward
    async def correct(self, trace) -> float:
        return float(trace.last_reply.strip() == str(self.data.a + self.data.b))

    @vf.reward(weight=0.2)
    async def used_tool(self, trace) -> float:
        return float(trace.info.get("tool_calls", 0) > 0)

    @vf.metric
    async def turns(self, trace) -> float:
        return float(trace.num_turns)


class CalcTaskset(vf.Taskset[CalcTask]):
    def load(self):
        for a in range(5):
            for b in range(5):
                yield CalcTask(CalcData(prompt=f"{a}+{b}=", a=a, b=b, name=f"{a}+{b}"), self.config.task)


class CalcHarness(vf.Harness[vf.HarnessConfig]):
    NEEDS_CONTAINER = False
    EXECUTES_CODE = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, **kwargs):
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret)
        messages = [{"role": "user", "content": data.prompt}]
        trace.info["tool_calls"] = 0
        try:
            for _ in range(MAX_TURNS):
                reply = await client.chat.completions.create(model=ctx.model, messages=messages)
                text = reply.choices[0].message.content or ""
                messages.append({"role": "assistant", "content": text})
                if not text.startswith("@"):
                    break
                trace.info["tool_calls"] += 1  # the calculator: the task's sum, as the next message
                messages.append({"role": "user", "content": f"={data.a + data.b}"})
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["CalcTaskset", "CalcHarness"]
