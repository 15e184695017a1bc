"""The parts behind "runs that end well", each on real processes, signals and files, no training:

- the output-folder lock: one run per folder, released by a holder's death (kill -9);
- a killed launcher's private temporary folder, removed by a later one (and a live one's kept);
- output whose reader is gone (a closed pipe) goes on into the run folder's log;
- stop signals: the first sets the flag, a second ends the process at once, a launcher's request
  carries its signal, an inherited "ignore" (nohup) is respected;
- the launcher's supervisor: its first signal reaches every rank as a request carrying the
  signal, a second kills the agent and its ranks at once;
- the failure report's order of witnesses; the hang watchdog's sentences;
- non-finite settings refused; the schedule wound back and the weights kept for skipped steps;
  weights that are not finite never saved.
"""
from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from lctrain.config import load_recipe
from lctrain.errors import ConfigError, UserError
from lctrain.launch.failures import explain, read_records, record_error
from lctrain.launch.lifetime import RunLock, alive, children
from lctrain.launch.rank import group_backend
from lctrain.launch.stopping import LAUNCHER_REQUEST, stopped_by
from lctrain.launch.watchdog import Watchdog, read_heartbeats


def _python(code: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code], **kwargs)


def test_one_run_per_output_folder_and_a_dead_holder_frees_it(tmp_path):
    holder = _python(f"from lctrain.launch.lifetime import RunLock\n"
                     f"import sys, time\nRunLock({str(tmp_path)!r}).acquire()\n"
                     f"print('held', flush=True)\ntime.sleep(60)",
                     stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with pytest.raises(UserError) as error:
        RunLock(tmp_path).acquire()
    assert str(error.value) == (f"{tmp_path} is in use by another lctrain run (pid {holder.pid} "
                                f"on {os.uname().nodename}); wait for it to finish or stop it, or "
                                "choose another train.output_dir.")
    holder.kill()  # kill -9: the kernel releases the lock
    holder.wait()
    with RunLock(tmp_path):
        with pytest.raises(UserError, match=f"pid {os.getpid()} "):  # a second holder in-process
            RunLock(tmp_path).acquire()
    with RunLock(tmp_path):  # released at the end of the block
        pass


_OWNER = """
import sys, time
from lctrain.launch.lifetime import private_folder
with private_folder() as folder:
    print(folder, flush=True)
    time.sleep(60)
"""


def test_a_killed_launchers_private_folder_is_removed_and_a_live_ones_kept(tmp_path):
    from lctrain.launch.lifetime import collect_private_folders

    env = {**os.environ, "TMPDIR": str(tmp_path)}
    owners = [_python(_OWNER, stdout=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    live, killed = [Path(owner.stdout.readline().strip()) for owner in owners]
    owners[1].kill()  # kill -9: nothing cleans up
    owners[1].wait()
    other_host, no_owner = tmp_path / "lctrain-launch-other", tmp_path / "lctrain-launch-new"
    other_host.mkdir()
    (other_host / "owner").write_text(f"{owners[1].pid} on elsewhere\n")
    no_owner.mkdir()  # just made: the owner file comes next
    assert killed.is_dir() and collect_private_folders(tmp_path) == [killed]
    assert live.is_dir() and other_host.is_dir() and no_owner.is_dir()
    owners[0].kill()
    owners[0].wait()
    assert collect_private_folders(tmp_path) == [live]


_WRITER = """
import os, sys
from lctrain.launch.output import kept_output
with kept_output(sys.argv[1]):
    print("first", flush=True)
    os.close(int(sys.argv[2]))  # its copy of the reader's end
    sys.stdin.readline()  # the test closed its copy: now there is no reader
    print("second", flush=True)
    print("third", file=sys.stderr)
print("after the block", flush=True)
"""


def test_output_whose_reader_is_gone_goes_on_into_the_log(tmp_path):
    for log in (tmp_path / "terminal.log", tmp_path / "missing" / "terminal.log"):
        reader, writer = os.pipe()
        child = subprocess.Popen([sys.executable, "-c", _WRITER, str(log), str(reader)],
                                 stdin=subprocess.PIPE, stdout=writer, stderr=writer,
                                 pass_fds=(reader,))
        os.close(writer)
        shown = b""
        while not shown.endswith(b"\n"):
            shown += os.read(reader, 100)
        os.close(reader)
        child.stdin.write(b"go\n")
        child.stdin.close()
        assert shown == b"first\n" and child.wait(timeout=60) == 0  # even without a log
        if log.parent.is_dir():
            assert log.read_text() == "second\nthird\nafter the block\n"


_STOPPER = """
import os, signal, sys, time
from pathlib import Path
from lctrain.launch.stopping import StopRequest
stop = StopRequest().__enter__()
stop.request_file = Path(sys.argv[1])
print("ready", flush=True)
for line in sys.stdin:
    if line.strip() == "?":
        print(stop.requested(), flush=True)
    else:
        os.kill(os.getpid(), int(line))
        time.sleep(0.2)
        print("alive", stop.requested(), flush=True)
"""


def _stop_signals_at_default(ignored=()) -> None:
    """The stopper's signals as a terminal would start it, whatever the test run inherited
    (a run under nohup ignores SIGHUP, a background job SIGINT); ``ignored`` ignored."""
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)


def _stopper(tmp_path, ignored=()) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", _STOPPER, str(tmp_path / "stop")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            preexec_fn=lambda: _stop_signals_at_default(ignored))
    assert proc.stdout.readline().strip() == "ready"
    return proc


def _ask(proc, line: str) -> str:
    proc.stdin.write(line + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def test_a_first_stop_signal_is_a_flag_and_a_second_ends_the_process(tmp_path):
    proc = _stopper(tmp_path)
    assert _ask(proc, "?") == "0"
    (tmp_path / "stop").write_text("2\n")  # the launcher got SIGINT and asks the ranks to stop
    assert _ask(proc, str(int(LAUNCHER_REQUEST))) == "alive 2"
    assert _ask(proc, str(int(LAUNCHER_REQUEST))) == "alive 2"  # a repeated request is harmless
    assert _ask(proc, str(int(signal.SIGTERM))) == "alive 15"  # its own signal wins
    proc.stdin.write(f"{int(signal.SIGHUP)}\n")  # a second stop signal: the default action
    proc.stdin.flush()
    assert proc.wait(timeout=30) == -signal.SIGHUP
    assert stopped_by(130) == signal.SIGINT and stopped_by(143) == signal.SIGTERM
    assert stopped_by(1) is None and stopped_by(137) is None


def test_an_ignored_signal_stays_ignored(tmp_path):
    """nohup ignores SIGHUP: the run must not stop when the terminal closes."""
    proc = _stopper(tmp_path, ignored=(signal.SIGHUP,))
    assert _ask(proc, str(int(signal.SIGHUP))) == "alive 0"
    assert _ask(proc, str(int(signal.SIGINT))) == "alive 2"
    proc.stdin.close()
    assert proc.wait(timeout=30) == 0


_RANK = """
import sys, time
from pathlib import Path
from lctrain.launch.stopping import StopRequest
stop = StopRequest().__enter__()
stop.request_file = Path(sys.argv[1]) / "stop"
while not stop.requested():
    time.sleep(0.02)
(Path(sys.argv[1]) / f"rank{sys.argv[2]}").write_text(str(stop.requested()))
time.sleep(120)
"""


def test_the_launcher_passes_a_signal_on_and_a_second_one_kills_everything(tmp_path):
    """The supervisor of a launcher over an agent with two ranks (python processes with the
    ranks' real stop handling): the first SIGTERM reaches both ranks as a request carrying
    SIGTERM; a second signal kills the ranks and the agent at once. (SIGTERM twice: a test run
    in the background or under nohup ignores SIGINT or SIGHUP, and so does the launcher then.)"""
    from lctrain.launch.supervisor import Supervisor

    (tmp_path / "errors").mkdir()
    agent = _python(f"import subprocess, sys, time\n"
                    f"ranks = [subprocess.Popen([sys.executable, '-c', {_RANK!r}, "
                    f"{str(tmp_path)!r}, str(r)]) for r in range(2)]\ntime.sleep(120)")
    supervisor = Supervisor(agent, tmp_path, on_signal_text="stopping")
    ranks = []

    def signal_twice():
        deadline = time.time() + 60
        while getattr(signal.getsignal(signal.SIGTERM), "__self__", None) is not supervisor:
            time.sleep(0.01)
        while len(ranks) < 2 and time.time() < deadline:
            ranks[:] = children(agent.pid)
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)
        while not all((tmp_path / f"rank{r}").exists() for r in range(2)):
            assert time.time() < deadline
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)

    sender = threading.Thread(target=signal_twice)
    sender.start()
    start = time.time()
    code = supervisor.wait()
    sender.join()
    assert code == 128 + signal.SIGTERM and time.time() - start < 60
    assert [(tmp_path / f"rank{r}").read_text() for r in range(2)] == ["15", "15"]
    assert (tmp_path / "stop").read_text() == f"{int(signal.SIGTERM)}\n"
    assert agent.returncode == -signal.SIGKILL
    time.sleep(0.2)
    assert len(ranks) == 2 and not any(alive(pid) for pid in ranks)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the launcher's handlers are gone


def test_the_report_names_the_cause_not_the_echoes(tmp_path):
    records = [{"rank": 0, "pid": 10, "time": 1.0, "kind": "bug", "message": "reset",
                "traceback": "Traceback ... Connection reset by peer"}]
    killed9 = {1: {"pid": 11, "exitcode": -9}, 0: {"pid": 10, "exitcode": 1}}
    out = explain(records, killed9, killed=set(), last_step=4)
    assert out.kind == "signal" and out.message.startswith(
        "rank 1 (pid 11) was killed by SIGKILL (the kernel's out-of-memory killer")
    assert out.message.endswith("after step 4, the last step the job completed")
    # a rank the launcher killed itself (after a hang report) is no cause
    hang = records + [{"rank": 0, "pid": 10, "time": 0.5, "kind": "hang", "message": "late"}]
    assert explain(hang, killed9, killed={11}, last_step=4).message == "late"
    user = [{"rank": 1, "pid": 11, "time": 3.0, "kind": "user", "message": "bad data"}]
    assert explain(records + user, killed9, killed=set(), last_step=None).message == "bad data"
    assert explain(records, {0: {"pid": 10, "exitcode": 1}}, killed=set(),
                   last_step=None).kind == "bug"
    stopped = explain([], {0: {"pid": 1, "exitcode": 143}, 1: {"pid": 2, "exitcode": 143}},
                      killed=set(), last_step=3)
    assert (stopped.kind, stopped.exit_code) == ("stopped", 143)
    again = explain([], {0: {"pid": 1, "exitcode": -15}}, killed=set(), last_step=None)
    assert again.message == "rank 0 (pid 1) was ended by SIGTERM"
    record_error(tmp_path, ValueError("boom"))  # a real record: kind, pid and traceback
    (got,) = read_records(tmp_path)
    assert (got["kind"], got["pid"], got["message"]) == ("bug", os.getpid(), "boom")
    assert "ValueError: boom" in got["traceback"]


def test_the_watchdog_names_the_late_ranks(tmp_path):
    hangs = []
    ranks = [Watchdog(tmp_path, rank=r, world_size=4, timeout=1.0, on_hang=hangs.append)
             for r in range(3)]  # rank 3 never starts
    with ranks[0], ranks[1], ranks[2]:
        ranks[2].enter("the forward and backward", 7)
        ranks[1].completed(6)
        ranks[0].enter("the gradient all-reduce", 7)
        deadline = time.time() + 20
        while not hangs and time.time() < deadline:
            time.sleep(0.05)
    assert len(hangs) == 2  # ranks 0 and 2 waited too long; rank 1 was between steps
    report = next(h for h in hangs if h.startswith("rank 0 "))
    assert report.startswith("rank 0 waited 1 s in the gradient all-reduce of step 7 "
                             "(train.collective_timeout is 1 s); these ranks did not arrive: ")
    assert "rank 1 (alive, but still between steps, after step 6)" in report
    assert "rank 2 (alive, but still in the forward and backward of step 7)" in report
    assert "rank 3 (no heartbeat at all: it never reached training)" in report
    beats = read_heartbeats(tmp_path)
    assert sorted(beats) == [0, 1, 2] and beats[1]["completed"] == 6
    assert beats[0]["pid"] == os.getpid()
    hangs.clear()  # two ranks in the same collective that never completes
    pair = [Watchdog(tmp_path / "pair", rank=r, world_size=2, timeout=1.0, on_hang=hangs.append)
            for r in range(2)]
    with pair[0], pair[1]:
        for watch in pair:
            watch.enter("the metrics all-reduce", 3)
        deadline = time.time() + 20
        while len(hangs) < 2 and time.time() < deadline:
            time.sleep(0.05)
    assert sorted(hangs)[0] == (
        "rank 0 waited 1 s in the metrics all-reduce of step 3 (train.collective_timeout is 1 s); "
        "every rank is alive and waiting in the same operation, so a collective never completes "
        "(the ranks disagree on what to run).")


def test_non_finite_settings_are_refused():
    for override, shown in [("train.lr=.inf", "inf"), ("train.lr=nan", "'nan'"),
                            ("train.weight_decay=-.inf", "-inf"), ("train.epochs=.nan", "nan"),
                            ("lora.dropout=.nan", "nan")]:
        key = override.split("=")[0]
        with pytest.raises(ConfigError) as error:
            load_recipe(None, [override])
        assert str(error.value) == (f"{key} is {shown} but must be a finite number "
                                    f"(from --set {override})")
    assert load_recipe(None, ["train.lr=1e10"]).train.lr == 1e10  # large is allowed


def test_skipped_steps_wind_the_schedule_back():
    from lctrain.train.nonfinite import NonFiniteSteps
    from lctrain.train.optim import build_optimizer

    model = torch.nn.Linear(3, 2)
    optimizer, scheduler = build_optimizer(model, lr=1.0, weight_decay=0.0, warmup_steps=4,
                                           total_steps=10, min_lr_ratio=0.1)
    steps = NonFiniteSteps(torch.device("cpu"))
    rates = []
    for bad in (False, True, True, False, True):
        rates.append(optimizer.param_groups[0]["lr"])
        model(torch.randn(4, 3)).sum().backward()
        before = [p.detach().clone() for p in model.parameters()]
        optimizer.found_inf = torch.tensor(float(bad))  # as the Trainer does
        optimizer.step()
        del optimizer.found_inf
        optimizer.zero_grad()
        same = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        assert same == bad  # fused AdamW leaves a skipped step's weights alone
        steps.count(torch.tensor(bad))
        scheduler.step()
        settled = steps.settle(steps.counters().tolist(), scheduler)  # a sync every step
        assert settled.new == int(bad)
    assert rates == [0.25, 0.5, 0.5, 0.5, 0.75]  # skipped steps do not advance the warm-up
    assert (settled.run, settled.longest) == (1, 1)
    assert scheduler.last_epoch == 2 and math.isclose(optimizer.param_groups[0]["lr"], 0.75)
    assert all(int(s["step"]) == 2 for s in optimizer.state.values())  # two updates applied


def test_a_model_with_non_finite_weights_is_never_saved(tmp_path):
    """A weight turned to inf (a hardware fault, a bad load) after a good checkpoint: the save
    is refused with a sentence and the good checkpoint is neither replaced nor rotated out."""
    from lctrain.parallel.context import ContextParallel
    from lctrain.parallel.mesh import build_mesh
    from lctrain.launch import rank
    from lctrain.train import runner
    from lctrain.checkpoint.reader import list_checkpoints

    cfg = load_recipe(None, ["data.seq_len=64", "data.max_documents=4", "parallel.cp=1",
                             "checkpoint.keep=1", "parallel.attention_backend=reference"],
                      output_dir=str(tmp_path / "run"), max_steps=4)
    with rank.worker_process(cfg) as accelerator:
        pmesh = build_mesh(1, device_type="cpu")
        cp = ContextParallel(pmesh, "distflash", "reference", device=accelerator.device)
        setup = runner.RunSetup(cfg=cfg, pmesh=pmesh, cp=cp, accelerator=accelerator)
        parts = runner.build_model(setup)
        trainer = runner.build_trainer(setup, parts, None)
        checkpointer = runner.make_checkpointer(setup, trainer)
        trainer.step = 1
        runner.save(setup, trainer, checkpointer)
        weight = next(parts.model.parameters())
        with torch.no_grad():
            weight[0, 0] = float("inf")
        trainer.step = 2
        with pytest.raises(UserError) as error:
            runner.save(setup, trainer, checkpointer)
    kept = list_checkpoints(tmp_path / "run" / "checkpoints")
    assert [s for s, _ in kept] == [1]
    assert str(error.value) == (
        "the model's weights are not finite after step 2, so no checkpoint was saved and none "
        f"was deleted; the last complete checkpoint is {kept[0][1]} (step 1); resume with: "
        f"lctrain finetune {tmp_path / 'run' / 'config.yaml'} --resume.")


def test_the_watchdog_times_a_layer_not_a_whole_step(tmp_path):
    """A forward and backward longer than the timeout is no hang while its layers keep
    finishing; one layer that stays longer than the timeout is."""
    import torch

    class Slow(torch.nn.Module):
        def __init__(self, seconds: float) -> None:
            super().__init__()
            self.seconds, self.weight = seconds, torch.nn.Parameter(torch.ones(3))

        def forward(self, hidden):
            time.sleep(self.seconds)
            return hidden * self.weight

    hangs = []
    for layers, expected in [([Slow(0.3) for _ in range(8)], 0), ([Slow(0.3), Slow(2.5)], 1)]:
        watch = Watchdog(tmp_path / str(expected), rank=0, world_size=1, timeout=1.0,
                         on_hang=hangs.append)
        with watch:
            watch.watch_layers(layers)
            watch.enter("the forward and backward", 1)
            hidden = torch.ones(3, requires_grad=True)
            for layer in layers:
                hidden = layer(hidden)
            hidden.sum().backward()
            watch.completed(1)
        assert len(hangs) == expected, hangs
        assert not watch._hooks and not layers[0]._forward_pre_hooks  # undone at exit
    assert hangs[0].startswith("rank 0 waited 1 s in the forward and backward of step 1 ")


@pytest.mark.parametrize("offload, backend", [("none", "nccl"), ("optimizer", "nccl"),
                                              ("state", "cpu:gloo,cuda:nccl")])
def test_the_default_group_reduces_host_gradients_only_where_the_state_is_on_the_host(
        offload, backend):
    """FSDP2's CPU offload keeps gradients on the host: their norm needs gloo beside NCCL."""
    cfg = load_recipe(None, [f"train.offload={offload}"])
    assert group_backend(cfg, cuda=True) == backend
    assert group_backend(cfg, cuda=False) == "gloo"
