"""The fuzzer in CI (issue 14): a few hundred seeded cases over every family, none of which may end in a
traceback, a signal, a hang, a memory blow-up, a multi-line error, silent non-finite logits or a left-over
file; and the harness itself shown to catch each of those when the code under test is broken on purpose
(a fork inherits the monkeypatched modules)."""
from __future__ import annotations

import faulthandler
import os
import signal
import stat
import time

import pytest

from pyinfer.converters import convert_hf_to_powergguf
from pyinfer.engine import driver
from pyinfer.errors import ModelFormatError
from pyinfer.formats.gguf_file import GGUFFile
from tools.fuzz import campaign
from tools.fuzz.campaign import FAMILIES, Case, Limits, Prepared, Seeds

CI_CASES = 312  # 12 per family; about 30 s on 2 cores
CI_SEED = 14


@pytest.fixture(scope="module")
def seeds(tmp_path_factory) -> Seeds:
    return Seeds(str(tmp_path_factory.mktemp("seeds")), None)


def test_seeded_run_has_no_bad_outcome(tmp_path):
    report = campaign.run(campaign.plan(FAMILIES, CI_CASES), CI_SEED, Limits(timeout_s=20), str(tmp_path), None)
    bad = [f"{c.family} --case {c.index} ({c.seed_name}): {c.outcome}: {c.detail}" for c in report.bad]
    assert not bad, f"replay with: python -m tools.fuzz --seed {CI_SEED} --family F --case N\n" + \
        "\n".join(bad)
    assert {c.family for c in report.cases} == set(FAMILIES)
    outcomes = {c.outcome for c in report.cases}
    assert {"ok", "error", "nonfinite_caught"} <= outcomes  # mutations bite, some files still run, NaN is reported
    print("\n" + report.table())


def _tree(root) -> dict[str, object]:
    """relative path -> file bytes, link target or kind, for every entry under root."""
    out: dict[str, object] = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            rel = os.path.relpath(path, root)
            if os.path.islink(path):
                out[rel] = ("link", os.path.relpath(os.readlink(path), root))
            elif os.path.isfile(path):
                with open(path, "rb") as f:
                    out[rel] = f.read()
            else:
                out[rel] = stat.S_IFMT(os.lstat(path).st_mode)
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_a_case_is_replayed_exactly(seeds, tmp_path, family):
    first, second = tmp_path / "a", tmp_path / "b"
    for where in (first, second):
        where.mkdir()
        campaign.prepare(Case(family, 3), CI_SEED, seeds, str(where))
    assert _tree(first) == _tree(second)


# ---- the harness catches what it is there to catch ----

def _run(seeds, tmp_path, family: str = "values", timeout: float = 20.0, index: int = 0) -> Case:
    tmp_path.mkdir(exist_ok=True)
    case = Case(family, index)
    campaign.run_case(case, CI_SEED, seeds, str(tmp_path), Limits(timeout_s=timeout, memory_mb=2048))
    return case


def _break_loading(monkeypatch, behaviour) -> None:
    def broken(self, path):
        behaviour()
    monkeypatch.setattr(GGUFFile, "__init__", broken)


def test_catches_silent_non_finite_logits(seeds, tmp_path, monkeypatch):
    monkeypatch.setattr(driver, "_check_finite", lambda logits, first_pos: None)
    cases = [_run(seeds, tmp_path / str(i), "tensor_data", index=i) for i in range(8)]
    assert "nonfinite" in {c.outcome for c in cases}, [(c.outcome, c.detail) for c in cases]


def test_catches_a_traceback(seeds, tmp_path, monkeypatch):
    _break_loading(monkeypatch, lambda: {}["missing"])
    case = _run(seeds, tmp_path)
    assert case.outcome == "traceback" and "KeyError" in case.detail


def test_catches_a_signal(seeds, tmp_path, monkeypatch):
    def crash():
        faulthandler.disable()  # pytest's, inherited by the fork: the child dies silently, as outside pytest
        os.kill(os.getpid(), signal.SIGSEGV)
    _break_loading(monkeypatch, crash)
    case = _run(seeds, tmp_path)
    assert (case.outcome, case.detail) == ("signal", "SIGSEGV")


def test_catches_a_hang(seeds, tmp_path, monkeypatch):
    _break_loading(monkeypatch, lambda: time.sleep(60))
    t0 = time.monotonic()
    assert _run(seeds, tmp_path, timeout=1.0).outcome == "timeout"
    assert time.monotonic() - t0 < 10


def test_memory_limit_counts_from_the_parents_size(seeds, tmp_path):
    """A parent already holding more address space than the limit (the suite, after loading transformers
    models) still runs cases: the limit is what a case adds."""
    import numpy as np

    alone = _run(seeds, tmp_path / "alone", "tensor_data")
    held = np.empty(3 << 30, np.uint8)  # 3 GiB of address space, never touched
    beside = _run(seeds, tmp_path / "beside", "tensor_data")
    del held
    assert (beside.outcome, beside.detail) == (alone.outcome, alone.detail.replace("/alone/", "/beside/"))


def test_catches_a_memory_blow_up(seeds, tmp_path, monkeypatch):
    _break_loading(monkeypatch, lambda: bytearray(8 << 30))
    assert _run(seeds, tmp_path).outcome == "memory"


def test_catches_a_multi_line_error(seeds, tmp_path, monkeypatch):
    def raise_two_lines():
        raise ModelFormatError("first line\nsecond line")
    _break_loading(monkeypatch, raise_two_lines)
    assert _run(seeds, tmp_path).outcome == "multiline"


def test_catches_a_left_over_temporary_file(seeds, tmp_path, monkeypatch):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    valid = Prepared(argv=[seeds.paths["hf-llama"], "-o", str(out_dir / "out.gguf")], out_dir=str(out_dir))
    monkeypatch.setattr(campaign, "prepare", lambda *args: valid)

    def leaves_a_part_file(outputs):
        (out_dir / ".out.gguf.1.part").write_bytes(b"")
        raise ModelFormatError("failed while writing")
    monkeypatch.setattr(convert_hf_to_powergguf, "write_atomically", leaves_a_part_file)
    case = _run(seeds, tmp_path, "hf_config")
    assert case.outcome == "leftover" and ".out.gguf.1.part" in case.detail


def test_a_sigterm_while_the_child_writes_its_result_is_not_a_harness_crash(seeds, tmp_path, monkeypatch):
    """The long run once crashed reading half a result file: the case's SIGTERM had arrived while the
    child wrote it. Results are now written whole or not at all."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    monkeypatch.setattr(campaign, "prepare", lambda *args: Prepared(gguf="unused", out_dir=str(out_dir),
                                                                    terminate_after=0.5))
    monkeypatch.setattr(campaign.targets, "load_target", lambda path, workdir: ("ok", ""))

    def slow_dump(obj, f):
        f.write("{")
        f.flush()
        time.sleep(5)
    monkeypatch.setattr(campaign.json, "dump", slow_dump)
    case = _run(seeds, tmp_path)
    assert case.outcome == "error" and "SIGTERM" in case.detail
