"""The local Hugging Face cache lookup (vramscope.find_hf_config, the exporter's --hf-model and
the command's), on a cache folder made here in huggingface_hub's layout."""
import json

import pytest

import vramscope
from vramscope._hub import name_from_path


def make_cache(root, repo="acme/tiny-llama", commit="0123abcd", with_ref=True):
    folder = root / "hub" / ("models--" + repo.replace("/", "--"))
    snapshot = folder / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    if with_ref:
        (folder / "refs").mkdir()
        (folder / "refs" / "main").write_text(commit)
    return snapshot / "config.json"


def test_a_hub_name_is_found_through_its_main_revision(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    config = make_cache(tmp_path)
    (config.parent.parent / "ffff").mkdir()  # another revision, not main's
    assert vramscope.find_hf_config("acme/tiny-llama") == config
    assert name_from_path(config) == "tiny-llama"
    # HF_HUB_CACHE wins over HF_HOME, as in huggingface_hub.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    with pytest.raises(ValueError, match="not in the Hugging Face cache .*elsewhere.*huggingface-cli download"):
        vramscope.find_hf_config("acme/tiny-llama")


def test_huggingface_hub_finds_the_same_file(tmp_path, monkeypatch):
    hub = pytest.importorskip("huggingface_hub")
    config = make_cache(tmp_path)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    theirs = hub.try_to_load_from_cache("acme/tiny-llama", "config.json", cache_dir=str(tmp_path / "hub"))
    assert vramscope.find_hf_config("acme/tiny-llama") == config
    assert str(config) == str(theirs)


def test_without_a_main_ref_one_snapshot_is_taken_and_two_are_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    config = make_cache(tmp_path, with_ref=False)
    assert vramscope.find_hf_config("acme/tiny-llama") == config
    other = config.parent.parent / "ffff"
    other.mkdir()
    (other / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="2 snapshots of it and no main revision"):
        vramscope.find_hf_config("acme/tiny-llama")


def test_folders_and_bad_names(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    (tmp_path / "mine").mkdir()
    with pytest.raises(ValueError, match="the folder has no config.json"):
        vramscope.find_hf_config(str(tmp_path / "mine"))
    (tmp_path / "mine" / "config.json").write_text("{}")
    assert vramscope.find_hf_config(str(tmp_path / "mine")) == tmp_path / "mine" / "config.json"
    assert name_from_path(tmp_path / "mine" / "config.json") == "mine"
    with pytest.raises(ValueError, match="a file; give its folder"):
        vramscope.find_hf_config(str(tmp_path / "mine" / "config.json"))
    for bad in ("a/b/c", "../etc", "-x/y", "", "x" * 200, "a b", "a--b/c", "org/name-", "org./name"):
        with pytest.raises(ValueError, match="not a Hub model name"):
            vramscope.find_hf_config(bad)


def test_a_model_without_an_org_and_a_hostile_main_ref(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    config = make_cache(tmp_path, repo="gpt2")
    assert vramscope.find_hf_config("gpt2") == config
    assert name_from_path(config) == "gpt2"  # the repository's name, not the commit's
    # refs/main naming a path out of the snapshots: not a revision; the one snapshot is taken.
    for hostile in ("../../../etc", "..", "a/b", "\xff\xfe" * 200, "x" * 300):
        (config.parents[2] / "refs" / "main").write_bytes(hostile.encode("utf-8", "surrogateescape")
                                                            if isinstance(hostile, str) else hostile)
        assert vramscope.find_hf_config("gpt2") == config
    assert name_from_path(tmp_path / "n\x1b[2Ja" / "config.json") == "n[2Ja"
