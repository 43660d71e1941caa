"""A trainer process for the test that kills one: attaches to a vLLM server and sends version
after version until it is killed, printing each version the server took."""

from __future__ import annotations

import asyncio
import os
import sys

from _vllm import set_version, trainer_model

import aiowsync
from aiowsync.vllm import VLLMServers


async def main(url: str) -> None:
    model = trainer_model()
    set_version(model, 0)
    scheme = aiowsync.SharedMemWeightSyncScheme()
    scheme.init_on_sender(model=model, num_workers=1)
    async with scheme, VLLMServers([url]).attach(scheme):
        await scheme.connect(timeout=120)
        print(f"pid {os.getpid()}", flush=True)
        seed = 0
        while True:
            seed += 1
            set_version(model, seed)
            result = await scheme.send(timeout=60)
            print(f"sent {result.version}", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
