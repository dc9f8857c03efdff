"""A cancelled generation ends even when SGLang swallows the cancel: its
_wait_one_response waits in asyncio.wait_for, which on Python 3.11 returns
the output instead of raising when the cancel lands as that output arrives.
A Ray Serve replica cancels once (client gone) and never again, so the
request ran to its end there (test_scale_ray's disconnect test)."""

import asyncio

from kvsieve.service.engine import EngineClient


class _SGLangLike:
    """async_generate streams one output per `period` s, waiting for each
    the way SGLang's tokenizer manager does."""

    def __init__(self, period: float):
        self.period, self.outputs, self.ended = period, 0, False

    async def async_generate(self, **_):
        event = asyncio.Event()

        async def decode():
            while True:
                await asyncio.sleep(self.period)
                event.set()

        async def stream():
            producer = asyncio.create_task(decode())
            try:
                while not self.ended:
                    await asyncio.wait_for(event.wait(), timeout=4)
                    event.clear()
                    self.outputs += 1
                    yield {"meta_info": {}, "output_ids": [self.outputs]}
            finally:
                producer.cancel()

        return stream()


def _client(engine) -> EngineClient:
    client = EngineClient.__new__(EngineClient)  # no sglang.Engine behind it
    client._engine = engine
    return client


def test_a_cancel_swallowed_by_sglang_still_ends_the_generation():
    async def main() -> list:
        outcomes = []
        for trial in range(20):
            engine = _SGLangLike(period=0.0)  # an output ready at every wake-up: the cancel is always swallowed
            client = _client(engine)

            async def consume():
                async for _ in client.generate([1], {}, f"r{trial}"):
                    pass

            task = asyncio.create_task(consume())
            await asyncio.sleep(0.01 + trial * 0.001)
            # From another thread, as Serve's call_future.cancel() does.
            asyncio.get_running_loop().call_soon_threadsafe(task.cancel)
            await asyncio.sleep(0.2)
            outcomes.append(task.cancelled())
            engine.ended = True  # a run-on generation ends here (a cancel would be swallowed again)
            await asyncio.gather(task, return_exceptions=True)
        return outcomes

    outcomes = asyncio.run(main())
    assert all(outcomes), f"{outcomes.count(False)} of {len(outcomes)} cancelled generations kept running"


def test_an_uncancelled_generation_runs_on():
    async def main() -> int:
        engine = _SGLangLike(period=0.001)
        n = 0
        async for _ in _client(engine).generate([1], {}, "r"):
            n += 1
            if n == 50:
                break
        return n

    assert asyncio.run(main()) == 50
