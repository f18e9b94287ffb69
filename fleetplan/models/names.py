"""Normalisation of engine, GPU, precision and model names.

Benchmark files, policy files and agents spell the same thing many ways: "H100 80GB HBM3",
"H100 SXM5" and "h100" are one GPU type; "tensorrt-llm", "trtllm" and "trt-llm" are one engine.
Everything inside fleetplan uses the enums below; spellings are parsed at the edges.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum


class UnknownNameError(ValueError):
    """A name that does not normalise to a known key; the message lists what is accepted."""


class Engine(StrEnum):
    VLLM = "vllm"
    TRTLLM = "trtllm"


class GpuType(StrEnum):
    A100 = "a100"
    L40S = "l40s"
    H100 = "h100"
    H200 = "h200"
    GH200 = "gh200"
    B200 = "b200"
    GB200 = "gb200"
    RTX4090 = "rtx4090"


class Precision(StrEnum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP8 = "fp8"
    FP4 = "fp4"
    INT8 = "int8"
    INT4 = "int4"


def _squash(text: str) -> str:
    return re.sub(r"[^a-z0-9]", "", text.lower())


_ENGINE_SPELLINGS: dict[str, Engine] = {
    "vllm": Engine.VLLM,
    "tensorrtllm": Engine.TRTLLM,
    "trtllm": Engine.TRTLLM,
    "tensorrt": Engine.TRTLLM,
    "trtllmserve": Engine.TRTLLM,
    "tritontensorrtllm": Engine.TRTLLM,
}


def parse_engine(text: str) -> Engine:
    """'tensorrt-llm', 'TRT-LLM', 'trtllm' -> Engine.TRTLLM; 'vLLM' -> Engine.VLLM."""
    key = _squash(text)
    if key in _ENGINE_SPELLINGS:
        return _ENGINE_SPELLINGS[key]
    raise UnknownNameError(f"unknown engine {text!r}; expected one of: vllm, trtllm (tensorrt-llm, trt-llm)")


# Longest prefixes first so that "gh200" is not read as "h200" and "h200" not as "h20".
_GPU_PREFIXES: tuple[tuple[str, GpuType], ...] = (
    ("gb200", GpuType.GB200),
    ("gh200", GpuType.GH200),
    ("b200", GpuType.B200),
    ("h200", GpuType.H200),
    ("h100", GpuType.H100),
    ("a100", GpuType.A100),
    ("l40s", GpuType.L40S),
    ("rtx4090", GpuType.RTX4090),
    ("geforcertx4090", GpuType.RTX4090),
    ("4090", GpuType.RTX4090),
)


def parse_gpu(text: str) -> GpuType:
    """'H100 80GB HBM3', 'H100 SXM5', 'NVIDIA H100', 'h100' -> GpuType.H100."""
    key = _squash(text)
    for prefix in ("nvidia", "tesla"):
        if key.startswith(prefix):
            key = key[len(prefix):]
    for prefix, gpu in _GPU_PREFIXES:
        if key.startswith(prefix):
            return gpu
    known = ", ".join(g.value for g in GpuType)
    raise UnknownNameError(f"unknown GPU {text!r}; known GPU types: {known}")


_PRECISION_SPELLINGS: dict[str, Precision] = {
    "bf16": Precision.BF16,
    "bfloat16": Precision.BF16,
    "fp16": Precision.FP16,
    "float16": Precision.FP16,
    "half": Precision.FP16,
    "fp8": Precision.FP8,
    "float8": Precision.FP8,
    "fp4": Precision.FP4,
    "nvfp4": Precision.FP4,
    "int8": Precision.INT8,
    "w8a8": Precision.INT8,
    "int4": Precision.INT4,
    "awq": Precision.INT4,
    "w4a16": Precision.INT4,
}


def parse_precision(text: str) -> Precision:
    key = _squash(text)
    if key in _PRECISION_SPELLINGS:
        return _PRECISION_SPELLINGS[key]
    known = ", ".join(p.value for p in Precision)
    raise UnknownNameError(f"unknown precision {text!r}; known: {known}")


# Bounds on what a benchmark file may say (models/ imports nothing from planner/ or controller/, so
# they are stated here): a TP size the rest of the system accepts (controller/protocol.py `Tp` and
# planner/policy.py `allowed.tp`: 1..64), and a model name that is one line of printable text of
# bounded length (the policy's canonical names are stricter: 1-200 of A-Z a-z 0-9 . _ / : + -; a
# file's name may be a spelling such as "LLaMA 3.1 8B" that an alias maps to a canonical name).
MAX_TP = 64
MAX_MODEL_NAME_CHARS = 256


def model_name_problem(name: str) -> str | None:
    """Why `name` cannot be a model name read from a benchmark file; None when it can.

    >>> model_name_problem("LLaMA 3.1 8B") is None
    True
    >>> model_name_problem("llama\\nx")
    'holds a non-printable character (a control character or line break)'
    >>> model_name_problem("m" * 257)
    'is longer than 256 characters'
    """
    if len(name) > MAX_MODEL_NAME_CHARS:
        return f"is longer than {MAX_MODEL_NAME_CHARS} characters"
    # str.isprintable: False for control (Cc: \n, \r, \t, \x00, \x7f, \x85), format (Cf: \u200b,
    # \ufeff), surrogate, private-use and unassigned characters, line/paragraph separators (\u2028)
    # and spaces other than the ASCII space (\u00a0)
    if not name.isprintable():
        return "holds a non-printable character (a control character or line break)"
    return None


def model_key(text: str) -> str:
    """A spelling-insensitive key for a model name: 'LLaMA 3.1 8B' -> 'llama318b'.

    Two names with the same key are the same model without any alias declared; anything else
    ("LLaMA 3.1 8B" vs "Llama-3.1-8B-Instruct") needs an alias in a ModelAliases table.
    """
    base = text.strip().split("/")[-1]
    return _squash(base)


@dataclass(frozen=True)
class ModelAliases:
    """Canonical model names and the spellings declared to mean them.

    >>> a = ModelAliases.build({"llama-3.1-8b": ["LLaMA 3.1 8B", "meta-llama/Llama-3.1-8B-Instruct"]})
    >>> a.canonical("Llama-3.1-8B-Instruct")
    'llama-3.1-8b'
    >>> a.canonical("some-other-model")
    'some-other-model'
    """

    by_key: Mapping[str, str] = field(default_factory=dict)

    @staticmethod
    def build(table: Mapping[str, Iterable[str]]) -> ModelAliases:
        by_key: dict[str, str] = {}
        for canonical, aliases in table.items():
            for spelling in (canonical, *aliases):
                key = model_key(spelling)
                previous = by_key.get(key)
                if previous is not None and previous != canonical:
                    raise ValueError(
                        f"model alias {spelling!r} is declared for both {previous!r} and {canonical!r}"
                    )
                by_key[key] = canonical
        return ModelAliases(by_key=by_key)

    def canonical(self, name: str) -> str:
        """The canonical name for `name`, or `name` itself when no alias covers it."""
        return self.by_key.get(model_key(name), name)
