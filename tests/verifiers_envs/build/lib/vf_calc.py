"""A multi-turn tool environment: `3+1=` asks for the sum. The model's first turn is a call to the calculator
(`@` is the well-formed call, rewarded by `called`, weight 0.2); the harness answers in the conversation with the
tool's result (`=4`), and the model's second turn is its answer (`correct`). The tool's answer is environment
text: verifiers' sampled mask keeps its tokens out of training."""

import os

import openai
import verifiers.v1 as vf


class CalcData(vf.TaskData):
    a: int = 0
    b: int = 0


class CalcTask(vf.Task[CalcData]):
    @vf.reward
    async def correct(self, trace) -> float:
        return float(trace.last_reply.strip() == str(self.data.a + self.data.b))

    @vf.reward(weight=0.2)
    async def called(self, trace) -> float:
        return float(trace.info.get("call", "").startswith("@"))

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
        kill = os.environ.get("VF_CALC_KILL_FILE")  # the tests' server death: the first episode to see the file
        if kill:
            try:
                os.remove(kill)
                os._exit(1)
            except FileNotFoundError:
                pass
        client = openai.AsyncOpenAI(base_url=endpoint, api_key=secret)
        messages = [{"role": "user", "content": data.prompt}]
        try:
            call = await client.chat.completions.create(model=ctx.model, messages=messages)
            trace.info["call"] = call.choices[0].message.content or ""
            messages += [{"role": "assistant", "content": trace.info["call"]},
                         {"role": "user", "content": f"={data.a + data.b}"}]  # the calculator's result
            await client.chat.completions.create(model=ctx.model, messages=messages)
        finally:
            await client.close()
        return vf.ProgramResult(exit_code=0, stdout="", stderr="")


__all__ = ["CalcTaskset", "CalcHarness"]
