"""probdiff_callback/models/loading.py: a hub id without network, or not in the cache offline, stops at once in one
line naming the id and what to do; its cached copy is used where there is one."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from probdiff_callback.cli import main as probdiff
from probdiff_callback.models import ModelUnavailable, load_model_and_tokenizer, resolve_model_path
from probdiff_callback.models.loading import hub_model_source
from probdiff_callback.training import sft

ROOT = Path(__file__).resolve().parents[1]
QUERIES = str(ROOT / "data" / "samples" / "blog" / "heldout.jsonl")
HUB_ID = "Qwen/Qwen2-0.5B-Instruct"


def error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


def reason_left_out(line: str) -> str:
    """The line with why the hub could not be reached (the OS's words) replaced by REASON."""
    return re.sub(r"cannot be reached \((.+?)\)(:| and)", r"cannot be reached (REASON)\2", line)


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@pytest.fixture
def hub(monkeypatch, tmp_path):
    """An empty Hugging Face cache and a hub endpoint that refuses connections (as without network, but at once
    and on any machine); HF_HUB_OFFLINE off. Returns the cache directory."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{closed_port()}")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    hub_model_source.cache_clear()
    yield cache
    hub_model_source.cache_clear()


@pytest.fixture
def hub_attempts(hub, monkeypatch) -> list[tuple]:
    """Each connection this process tries to the `hub` fixture's endpoint (huggingface_hub's client connects through
    `socket.create_connection`): how often the hub was asked, which is what "at once" comes down to (transformers,
    given a hub id it cannot reach, retries each file for about 50 s)."""
    from huggingface_hub import constants

    port = int(constants.ENDPOINT.rsplit(":", 1)[1])
    attempts: list[tuple] = []
    connect = socket.create_connection

    def counted(address, *args, **kwargs):
        if address[1] == port:
            attempts.append(address)
        return connect(address, *args, **kwargs)

    monkeypatch.setattr(socket, "create_connection", counted)
    return attempts


def test_hub_id_not_cached_with_hf_hub_offline_stops_at_once(hub, hub_attempts, monkeypatch, tmp_path, capsys):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert probdiff(["eval", "--model", HUB_ID, "--queries", QUERIES, "--out", str(tmp_path / "o")]) == 2
    assert hub_attempts == [], "offline: the hub is never asked"
    assert error_lines(capsys.readouterr().err) == [
        f"probdiff eval: error: --model {HUB_ID}: a hub id with no copy in the Hugging Face cache ({hub}), and "
        f"HF_HUB_OFFLINE=1 allows no download: give a local model directory, or download it first "
        f"(`hf download {HUB_ID}` where there is network)"
    ]
    with pytest.raises(ModelUnavailable, match=r"hf download Qwen/Qwen1.5-14B-Chat"):  # the presets' hub ids too
        resolve_model_path("qwen1.5-14b-chat")


def test_hub_id_with_the_hub_unreachable_stops_at_once(hub, hub_attempts, tmp_path, capsys, sft_in_this_process):
    from huggingface_hub import constants

    assert probdiff(["eval", "--model", HUB_ID, "--queries", QUERIES, "--out", str(tmp_path / "o")]) == 2
    assert len(hub_attempts) == 1, "one probe of the hub, no retries, no download tried"
    assert sft.main(["recipe=blog", f"model={HUB_ID}", "report_to=none", f"output_dir={tmp_path}/r"]) == 2
    assert len(hub_attempts) == 2, "the training script's own probe, and nothing more"
    expected = (
        f"a hub id, but the Hugging Face Hub ({constants.ENDPOINT}) cannot be reached (REASON) and the cache ({hub}) "
        "has no copy of it: give a local model directory, or download it first "
        f"(`hf download {HUB_ID}` where there is network) and run with HF_HUB_OFFLINE=1"
    )
    assert [reason_left_out(line) for line in error_lines(capsys.readouterr().err)] == [
        f"probdiff eval: error: --model {HUB_ID}: {expected}",
        f"error: model={HUB_ID}: {expected}",
    ]


def test_hub_id_with_the_hub_unreachable_loads_its_cached_copy(hub, tiny_model_path, capsys):
    snapshot = hub / "models--probdiff--tiny-copy" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_model_path, snapshot)
    (hub / "models--probdiff--tiny-copy" / "refs").mkdir()
    (hub / "models--probdiff--tiny-copy" / "refs" / "main").write_text("0" * 40)
    assert resolve_model_path("probdiff/tiny-copy") == str(snapshot)
    model, _ = load_model_and_tokenizer("probdiff/tiny-copy", dtype="float32")
    assert model.config.num_hidden_layers == 2
    notes = [reason_left_out(line) for line in capsys.readouterr().err.splitlines() if "cannot be reached" in line]
    assert notes == [  # once per process
        f"note: the Hugging Face Hub cannot be reached (REASON): loading probdiff/tiny-copy "
        f"from the cache ({snapshot}); HF_HUB_OFFLINE=1 skips this check"
    ]


def test_a_directory_without_weights_is_one_line(tmp_path, capsys, tiny_model_path):
    (tmp_path / "m").mkdir()
    shutil.copy(tiny_model_path / "config.json", tmp_path / "m" / "config.json")
    with pytest.raises(ModelUnavailable, match=r"^cannot be loaded: Error no file named model.safetensors"):
        load_model_and_tokenizer(str(tmp_path / "m"))
    assert probdiff(["eval", "--model", str(tmp_path / "m"), "--queries", QUERIES, "--out", str(tmp_path / "o")]) == 2
    [line] = error_lines(capsys.readouterr().err)
    assert line.startswith(f"probdiff eval: error: --model {tmp_path / 'm'}: cannot be loaded: Error no file named")


@pytest.mark.slow
def test_probdiff_eval_without_network_says_so_in_one_line(tmp_path):
    """As the user ran it: a process with HF_HUB_OFFLINE unset and the hub unreachable; once about 50 s of retry
    lines and a 30-line traceback."""
    env = {**os.environ, "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": f"http://127.0.0.1:{closed_port()}"}
    env.pop("HF_HUB_OFFLINE", None)
    env.pop("TRANSFORMERS_OFFLINE", None)
    done = subprocess.run(
        [sys.executable, "-m", "probdiff_callback.cli", "eval", "--model", HUB_ID, "--queries", QUERIES, "--out",
         str(tmp_path / "o")],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2
    assert "Traceback" not in done.stderr and "Retrying" not in done.stderr  # no download tried, none retried
    [line] = error_lines(done.stderr)
    assert line.startswith(f"probdiff eval: error: --model {HUB_ID}: a hub id, but the Hugging Face Hub")
