"""Ranks on other machines (issue 44): ``kvledger serve --nnodes N --node-rank R`` as vLLM
runs it, machine 0 serving the API and the others headless, here as processes of one
machine over 127.0.0.1. Greedy tokens equal one process's; a machine that dies (or whose
rank dies) ends the others within seconds; the control channel admits only peers that
hold $KVLEDGER_NODE_KEY, and one that stalls or lies cannot hold up the rest."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
from _server_helpers import free_port, reap, wait_for_serve

from kvledger.engine.cli import main
from kvledger.engine.core import nodes as node_channel
from kvledger.engine.core.rank_messages import RankSpec, Start
from kvledger.engine.errors import BadInput
from kvledger.engine.llm import LLM
from kvledger.engine.sampling.params import SamplingParams
from kvledger.engine.settings.node_config import NODE_KEY_ENV, Nodes, free_port_pair

KEY = "kvledger-test-key-0123456789"
PROMPTS = [[1, 5, 9, 33, 7, 21, 2], [2, 3, 4], list(range(10, 60))]


class Machines:
    """Machine 0 (``kvledger serve``, the API) and machine 1 (headless), their logs in
    files (a pipe left unread would block a process that logs)."""

    def __init__(self, model_dir: Path, logs: Path, *flags: str, key: str = KEY,
                 machine_1: tuple[str, ...] = (), late: bool = False) -> None:
        """``late``: machine 1 waits for ``start_machine_1`` (machine 0 waits for it)."""
        self.port, master = free_port(), free_port_pair()
        while self.port in (master, master + 1):
            master = free_port_pair()
        env = {**os.environ, NODE_KEY_ENV: key}
        common = [sys.executable, "-m", "kvledger.engine.cli", "serve", str(model_dir),
                  "--device", "cpu", "--dtype", "float32", "--max-model-len", "128",
                  *flags, "--nnodes", "2", "--master-addr", "127.0.0.1",
                  "--master-port", str(master)]
        self.logs = [logs / "machine0.log", logs / "machine1.log"]
        self.procs = [
            subprocess.Popen([*common, "--node-rank", "0", "--host", "127.0.0.1", "--port",
                              str(self.port)], env=env, stderr=self.logs[0].open("w"),
                             stdout=subprocess.DEVNULL)]
        self._machine_1 = ([*common, "--node-rank", "1", "--headless", *machine_1], env)
        if not late:
            self.start_machine_1()

    def start_machine_1(self) -> None:
        command, env = self._machine_1
        self.procs.append(subprocess.Popen(command, env=env, stderr=self.logs[1].open("w"),
                                           stdout=subprocess.DEVNULL))

    def log(self, machine: int) -> str:
        return self.logs[machine].read_text()

    def ready(self) -> None:
        try:
            wait_for_serve(self.procs[0], self.port, timeout_s=150)
        except BaseException:
            print(f"machine 0:\n{self.log(0)}\nmachine 1:\n{self.log(1)}")
            raise

    def complete(self, prompt: list[int]) -> list[int]:
        """Greedy token ids of a completion of ``prompt`` (its logprobs name them)."""
        body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                           "ignore_eos": True, "logprobs": 0,
                           "return_tokens_as_token_ids": True}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
        answer = json.loads(urllib.request.urlopen(request, timeout=60).read())
        tokens = answer["choices"][0]["logprobs"]["tokens"]
        return [int(t.removeprefix("token_id:")) for t in tokens]

    def rank_of(self, machine: int) -> int:
        """The pid of a rank process of ``machine`` (not multiprocessing's tracker)."""
        out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(self.procs[machine].pid)],
                             capture_output=True, text=True, check=False).stdout
        return next(int(p) for p in out.split()
                    if b"resource_tracker" not in Path(f"/proc/{p}/cmdline").read_bytes())

    def wait(self, machine: int, since: float, limit_s: float = 30) -> tuple[int, float]:
        """``machine``'s exit status and how long after ``since`` it came."""
        proc = self.procs[machine]
        while proc.poll() is None and time.monotonic() - since < limit_s:
            time.sleep(0.05)
        return proc.returncode, time.monotonic() - since

    def reap(self) -> None:
        for proc in self.procs:
            reap(proc)


@pytest.fixture
def machines(tmp_path):
    started: list[Machines] = []

    def start(model_dir: Path, *flags: str, **options) -> Machines:
        started.append(Machines(model_dir, tmp_path, *flags, **options))
        return started[-1]

    yield start
    for group in started:
        group.reap()


def _one_process(model_dir: Path) -> list[list[int]]:
    llm = LLM(str(model_dir), device="cpu", dtype="float32", max_model_len=128)
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("name", "flags"), [
    ("tiny-llama", ("-pp", "2")),
    ("tiny-qwen2", ("-pp", "2", "-tp", "2")),  # each machine a stage of two ranks
])
def test_two_machines_answer_as_one_process(make_model_dir, machines, name, flags) -> None:
    model_dir = make_model_dir(name)
    expected = _one_process(model_dir)
    group = machines(model_dir, *flags, "--served-model-name", "m")
    group.ready()
    assert [group.complete(prompt) for prompt in PROMPTS] == expected
    assert "ranks ready on 2 machines" in group.log(0)
    # machine 0 stopped (SIGTERM, as the kubelet stops it): machine 1's ranks stop with it
    group.procs[0].send_signal(signal.SIGTERM)
    assert group.wait(0, time.monotonic())[0] == 0
    code, after = group.wait(1, time.monotonic())
    assert (code, after < 10) == (0, True), group.log(1)


@pytest.mark.timeout(240)
def test_a_rank_of_another_machine_that_dies_ends_both(tiny_llama_dir, machines) -> None:
    group = machines(tiny_llama_dir, "-pp", "2", "--served-model-name", "m")
    group.ready()
    group.complete([1, 2, 3])
    killed = time.monotonic()
    os.kill(group.rank_of(1), signal.SIGKILL)
    code, after = group.wait(0, killed)
    assert code == 1 and after < 10, group.log(0)
    assert "rank 1 of 2 at 127.0.0.1:" in group.log(0)
    assert group.wait(1, killed)[0] == 1


@pytest.mark.timeout(240)
def test_machine_zero_that_dies_ends_the_other(tiny_llama_dir, machines) -> None:
    group = machines(tiny_llama_dir, "-pp", "2", "--served-model-name", "m")
    group.ready()
    killed = time.monotonic()
    group.procs[0].kill()  # its own rank 0 dies with it: the channel closes
    code, after = group.wait(1, killed)
    assert code == 1 and after < 10, group.log(1)
    assert "rank 0 is gone" in group.log(1)


@pytest.mark.timeout(120)
def test_a_machine_with_too_small_a_device_is_refused_before_any_rank_loads(
        tiny_llama_dir, machines) -> None:
    """Machine 0 plans on the smallest machine's device as the machines join: one that
    cannot hold its stage ends the run with the breakdown (exit 3), and the machine
    hears why, instead of running out of memory as it loads."""
    group = machines(tiny_llama_dir, "-pp", "2", machine_1=("--device-memory", "64MiB"))
    assert group.wait(0, time.monotonic(), limit_s=90)[0] == 3, group.log(0)
    log = group.log(0)
    assert ("the plan does not fit rank 1's machine (--node-rank 1): what-if device, 64.0 MiB "
            "free, less than this machine's") in log
    assert "error: engine requires" in log and "per GPU on stage" in log
    assert group.wait(1, time.monotonic())[0] == 1
    assert "machine 0 refused rank 1: the plan does not fit rank 1's machine" in group.log(1)
    assert "loading" not in group.log(1).lower()


@pytest.mark.timeout(120)
def test_machine_zero_plans_on_a_smaller_machine_that_fits(tiny_llama_dir, machines) -> None:
    group = machines(tiny_llama_dir, "-pp", "2", "--served-model-name", "m",
                     machine_1=("--device-memory", "4GiB"))
    group.ready()
    assert ("planned on rank 1's machine (--node-rank 1): what-if device, 4.0 GiB free, less "
            "than this machine's") in group.log(0)
    with urllib.request.urlopen(f"http://127.0.0.1:{group.port}/v1/budget") as answer:
        device = json.loads(answer.read())["plan"]["device"]
    assert (device["name"], device["free_bytes"]) == ("what-if device", 4 * 2**30)


@pytest.mark.timeout(120)
def test_a_machine_with_another_key_never_joins(tiny_llama_dir, machines, tmp_path) -> None:
    """The intruder knocks while machine 0 waits for its machine 1 (once it has joined, the
    port is closed to everyone), is refused and exits; the right machine 1 joins after."""
    group = machines(tiny_llama_dir, "-pp", "2", late=True)
    env = {**os.environ, NODE_KEY_ENV: "another-key-of-enough-length"}
    master = _master_port(group)
    intruder = subprocess.run(
        [sys.executable, "-m", "kvledger.engine.cli", "serve", str(tiny_llama_dir), "--device",
         "cpu", "--dtype", "float32", "--max-model-len", "128", "-pp", "2", "--nnodes", "2",
         "--node-rank", "1", "--master-port", str(master)], env=env, capture_output=True,
        text=True, timeout=100)
    assert intruder.returncode != 0
    assert "did not prove it holds $KVLEDGER_NODE_KEY" in group.log(0)
    group.start_machine_1()
    group.ready()  # the right machine 1 joins all the same


def _master_port(group: Machines) -> int:
    args = group.procs[0].args
    return int(args[args.index("--master-port") + 1])


@pytest.mark.timeout(120)
def test_machine_zero_gives_up_on_a_machine_that_never_comes(tiny_llama_dir, monkeypatch) -> None:
    """Its start fails naming the missing ranks, and leaves nothing behind: an engine
    started next in the same process runs."""
    monkeypatch.setattr(node_channel, "JOIN_TIMEOUT_S", 2.0)
    nodes = Nodes(2, 0, "127.0.0.1", free_port_pair(), KEY.encode())
    import torch

    threads = torch.get_num_threads()
    started = time.monotonic()
    with pytest.raises(node_channel.NodeLost, match=r"ranks \[1\] \(--nnodes 2\) did not join"):
        LLM(str(tiny_llama_dir), device="cpu", dtype="float32", max_model_len=128,
            pipeline_parallel_size=2, nodes=nodes)
    assert time.monotonic() - started < 30
    assert torch.get_num_threads() == threads  # the ranks' share given back
    assert len(_one_process(tiny_llama_dir)) == len(PROMPTS)


# The channel itself, in one process --------------------------------------------------------

def _nodes(port: int, key: bytes = KEY.encode(), rank: int = 1) -> Nodes:
    return Nodes(count=2, rank=rank, master_addr="127.0.0.1", master_port=port - 1, key=key)


def _accept_in_thread(nodes: Nodes, remote: list[int], print_: str = "m", **kw):
    box: dict = {}

    def run() -> None:
        try:
            box["joined"] = node_channel.accept_ranks(nodes, remote, print_, **kw)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _join_in_thread(nodes: Nodes, rank: int, print_: str = "m"):
    box: dict = {}

    def run() -> None:
        try:
            box["joined"] = node_channel.join(nodes, rank, print_, deadline_s=20)
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


SPEC = RankSpec(model_dir="/m", world=2, device="cpu", dtype="float32", max_model_len=128,
                block_size=16, master_port=29500, timeout_s=60.0, stages=2, nodes=2)


def _spec_to(box: dict) -> None:
    for channel in box["joined"].values():
        channel.send(Start(SPEC))


def test_a_silent_connection_and_a_wrong_key_do_not_hold_up_the_right_rank(monkeypatch) -> None:
    monkeypatch.setattr(node_channel, "SILENCE_S", 3.0)
    port = free_port()
    leader, box = _accept_in_thread(_nodes(port), [1])
    time.sleep(0.3)
    silent = socket.create_connection(("127.0.0.1", port))  # connects, then says nothing
    _, wrong = _join_in_thread(_nodes(port, b"not-the-key-at-all"), 1)
    rank, joined = _join_in_thread(_nodes(port), 1)
    leader.join(10)
    assert list(box["joined"]) == [1]
    _spec_to(box)
    rank.join(10)
    assert joined["joined"][1] == SPEC
    time.sleep(0.5)
    assert isinstance(wrong.get("error"), BadInput)
    assert "holds another $KVLEDGER_NODE_KEY" in str(wrong["error"])
    silent.close()


def test_a_rank_of_another_model_is_refused_by_name() -> None:
    port = free_port()
    leader, box = _accept_in_thread(_nodes(port), [1], print_="model-a")
    rank, joined = _join_in_thread(_nodes(port), 1, print_="model-b")
    leader.join(10)
    rank.join(10)
    assert "rank 1 (127.0.0.1:" in str(box["error"]) and "another model" in str(box["error"])
    assert "machine 0 refused rank 1" in str(joined["error"])


def test_a_rank_that_is_not_another_machines_is_refused() -> None:
    port = free_port()
    leader, box = _accept_in_thread(_nodes(port), [2, 3], deadline_s=3)
    _, rank_zero = _join_in_thread(_nodes(port), 0)  # claims machine 0's own rank
    rank_two, two = _join_in_thread(_nodes(port), 2)
    leader.join(10)
    assert "ranks [3]" in str(box["error"]) and "did not join" in str(box["error"])
    assert "is not a rank of another machine" in str(rank_zero["error"])
    rank_two.join(10)
    assert "error" in two  # machine 0 gave up: the channel closed


def test_a_silent_peer_is_lost_within_the_silence(monkeypatch) -> None:
    """A machine whose network is gone sends no pulse: rank 0's reader fails it."""
    from kvledger.engine.core.rank_follower import Follower

    monkeypatch.setattr(node_channel, "SILENCE_S", 0.5)
    port = free_port()
    leader, box = _accept_in_thread(_nodes(port), [1])
    rank, _ = _join_in_thread(_nodes(port), 1)
    leader.join(10)
    follower = Follower(1, box["joined"][1])
    _spec_to(box)
    rank.join(10)  # the rank's side never pulses: it went silent
    start = time.monotonic()
    while follower.gone(2) is None and time.monotonic() - start < 5:
        time.sleep(0.05)
    assert "sent nothing for 0.5 s" in (follower.gone(2) or "")
    assert time.monotonic() - start < 2


@pytest.mark.parametrize(("flags", "env", "message"), [
    (["--nnodes", "2", "-pp", "2"], {}, "set $KVLEDGER_NODE_KEY"),
    (["--nnodes", "2", "-pp", "2"], {NODE_KEY_ENV: "short"}, "16 characters or more"),
    (["--nnodes", "2", "--node-rank", "2"], {NODE_KEY_ENV: KEY}, "--node-rank must be in 0..1"),
    (["--nnodes", "3", "-pp", "2"], {NODE_KEY_ENV: KEY}, "do not split evenly over 3"),
    (["--headless"], {}, "machine 0 (--node-rank 0) serves the API"),
    (["--nnodes", "0"], {}, "--nnodes must be at least 1"),
])
def test_machine_flags_that_cannot_make_a_run_exit_2(tiny_llama_dir, capsys, monkeypatch, flags,
                                                     env, message) -> None:
    monkeypatch.delenv(NODE_KEY_ENV, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert main(["serve", str(tiny_llama_dir), "--device", "cpu", *flags]) == 2
    assert message in capsys.readouterr().err
