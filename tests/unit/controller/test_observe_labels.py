"""Which label names a series' model: the target's `model`, else the engine's `model_name`, never
trtllm-serve's placeholder "undefined"."""

from __future__ import annotations

from fleetplan.controller.observe import Observer, PromClient, Sample


async def test_model_label_precedence_and_trtllm_placeholder() -> None:
    client = PromClient("http://127.0.0.1:9")
    try:
        obs = Observer(client, canonical=str.lower)
        trt = {"model_name": "undefined", "engine_type": "undefined"}
        assert obs._model_of({**trt, "model": "Llama-3-70B"}) == "llama-3-70b"
        assert obs._model_of(trt) is None  # no model at all, not a model called "undefined"
        assert obs._model_of({"model_name": "llama-3-8b", "engine": "0"}) == "llama-3-8b"
        grouped = obs._group([Sample({**trt, "model": "a"}, 2.0), Sample({**trt, "model": "a"}, 3.0), Sample(trt, 7.0)])
        assert grouped == {"a": 5.0}
    finally:
        await client.aclose()
