"""--distributed-executor-backend and --data-parallel-backend (vLLM's flags and names): mp by
default, ray (and uni for the workers) accepted, the combinations the Ray backends do not run
refused before anything starts, naming why."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from actors.engine.args import EngineArgs
from actors.runtime.ray_nodes import RayClusterError, connect
from tests.e2e.server import free_port
from tools import serve

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def backend(*argv: str, which: str = "distributed_executor_backend") -> str:
    return getattr(EngineArgs.from_cli_args(serve.parse_args(list(argv))).create_engine_config().parallel, which)


def test_the_flag_takes_vllms_names_and_mp_stays_the_default(capsys):
    assert backend() == "mp"
    assert backend("-tp", "2") == "mp"
    assert backend("-tp", "2", "--distributed-executor-backend", "ray") == "ray"
    assert backend("--distributed-executor-backend", "uni") == "uni"
    assert EngineArgs(distributed_executor_backend="ray", pipeline_parallel_size=2).create_engine_config() \
        .parallel.distributed_executor_backend == "ray"
    kv = {"kv_connector": "TroupeConnector", "kv_role": "kv_both"}
    for which in ("distributed_executor_backend", "data_parallel_backend"):     # a KV connector on either
        assert EngineArgs(**{which: "ray"}, kv_transfer_config=kv).create_engine_config().kv_transfer is not None
    with pytest.raises(SystemExit) as exc:
        serve.parse_args(["--distributed-executor-backend", "external_launcher"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--distributed-executor-backend" in err and "'mp', 'ray', 'uni'" in err
    assert backend("-dp", "2", which="data_parallel_backend") == "mp"
    assert backend("-dp", "2", "-dpb", "ray", which="data_parallel_backend") == "ray"
    assert backend("-dp", "2", "--data-parallel-backend", "ray", "--distributed-executor-backend", "ray") == "ray"
    with pytest.raises(SystemExit) as exc:
        serve.parse_args(["--data-parallel-backend", "uni"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--data-parallel-backend" in err and "'mp', 'ray'" in err


def test_combinations_the_ray_backend_does_not_run_are_refused_naming_why():
    with pytest.raises(ValueError, match="'uni' runs one worker.*ask for 2"):
        EngineArgs(distributed_executor_backend="uni", tensor_parallel_size=2).create_engine_config()
    with pytest.raises(ValueError, match="data_parallel_backend 'ray' places engine cores on a Ray cluster: it "
                                         "needs the multiprocess"):
        EngineArgs(data_parallel_backend="ray", multiprocess=False).create_engine_config()
    with pytest.raises(ValueError, match="'ray' places worker processes on a Ray cluster: it needs the multiprocess"):
        EngineArgs(distributed_executor_backend="ray", multiprocess=False).create_engine_config()
    with pytest.raises(ValueError, match="unknown distributed_executor_backend 'mpi'; accepted: mp, ray, uni"):
        EngineArgs(distributed_executor_backend="mpi").create_engine_config()


def test_without_ray_installed_the_ray_backend_says_to_pip_install_ray():
    code = ("import sys; sys.modules['ray'] = None\n"          # ray cannot be imported in this process
            "from actors.engine.args import EngineArgs\n"
            "EngineArgs(tensor_parallel_size=2).create_engine_config()\n"     # mp needs no Ray
            "try:\n"
            "    EngineArgs(tensor_parallel_size=2, distributed_executor_backend='ray').create_engine_config()\n"
            "except ValueError as exc:\n"
            "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert out.returncode == 0, out.stderr
    assert "needs Ray, which is not installed here: pip install ray" in out.stdout


def test_with_no_cluster_at_ray_address_the_error_names_ray_start_head(monkeypatch):
    pytest.importorskip("ray", reason="needs Ray (pip install ray)")
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{free_port()}")        # nothing listens there
    with pytest.raises(RayClusterError, match=r"no Ray cluster answers at RAY_ADDRESS 127\.0\.0\.1:\d+ .*"
                                              r"`ray start --head`"):
        connect()


def parallel(*argv: str):
    return EngineArgs.from_cli_args(serve.parse_args(list(argv))).create_engine_config().parallel


def test_headless_machines_ranks_are_the_ones_past_the_servers_and_bad_layouts_are_refused(capsys):
    p = parallel("-dp", "4", "--data-parallel-size-local", "2", "--data-parallel-address", "10.0.0.1",
                 "--data-parallel-rpc-port", "13345")
    assert list(p.local_ranks) == [0, 1] and p.remote_ranks == [2, 3]
    assert (p.data_parallel_address, p.data_parallel_rpc_port) == ("10.0.0.1", 13345)
    p = parallel("--headless", "-dp", "4", "-dpl", "2", "-dpr", "2", "-dpa", "10.0.0.1", "-dpp", "13345")
    assert list(p.local_ranks) == [2, 3] and p.remote_ranks == [0, 1]
    plain = parallel("-dp", "2")                                           # vLLM's defaults: every rank here
    assert list(plain.local_ranks) == [0, 1] and plain.remote_ranks == []
    assert (plain.data_parallel_address, plain.data_parallel_rpc_port) == ("127.0.0.1", 29550)
    server_only = parallel("-dp", "2", "-dpl", "0")                       # vLLM's: the server, no engine core
    assert list(server_only.local_ranks) == [] and server_only.remote_ranks == [0, 1]
    assert list(parallel("--headless", "-dp", "2", "-dpl", "2").local_ranks) == [0, 1]   # ... they run elsewhere
    for argv, words in ((["--headless"], "--headless runs some of a server's data-parallel engine cores"),
                        (["--headless", "-dp", "2", "-dpl", "0"], "--headless runs some of a server's"),
                        (["-dp", "2", "-dpl", "1", "-dpr", "1"], "hybrid load balancing")):
        with pytest.raises(SystemExit) as exc:
            serve.parse_args(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and words in err, err
    with pytest.raises(ValueError, match="data_parallel_start_rank 3 \\+ data_parallel_size_local 2 is more than "
                                         "data_parallel_size 4"):
        parallel("--headless", "-dp", "4", "-dpl", "2", "-dpr", "3")
    with pytest.raises(ValueError, match="goes with data_parallel_backend 'mp'"):
        EngineArgs(data_parallel_size=2, data_parallel_size_local=1, data_parallel_backend="ray").create_engine_config()
    with pytest.raises(SystemExit) as exc:                               # load balancing: a server of its own
        serve.parse_args(["--headless", "-dp", "2", "--data-parallel-rank", "1"])
    assert exc.value.code == 2 and "give every machine a server of its own" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        serve.parse_args(["-dp", "4", "-dpl", "2", "-dpr", "2"])
    assert exc.value.code == 2 and "with --data-parallel-hybrid-lb" in capsys.readouterr().err
    with pytest.raises(ValueError, match="give this server's --data-parallel-rank"):
        parallel("-dp", "2", "--data-parallel-external-lb")
    with pytest.raises(ValueError, match="a server of that one rank"):
        parallel("-dp", "4", "-dpn", "1", "-dpl", "2")
    with pytest.raises(ValueError, match="hybrid load balancing .a server per machine. needs"):
        parallel("-dp", "4", "--data-parallel-hybrid-lb")


def test_external_and_hybrid_load_balancing_serve_this_servers_own_ranks_under_their_numbers():
    one = parallel("-dp", "2", "--data-parallel-rank", "1")
    assert (list(one.served_ranks), one.remote_ranks, one.data_parallel_rank) == ([1], [], 1)
    assert one.data_parallel_external_lb and parallel("-dp", "2", "-dpn", "1", "-dpe") == one
    machine = parallel("-dp", "4", "-dpl", "2", "-dpr", "2", "--data-parallel-hybrid-lb")
    assert (list(machine.served_ranks), machine.remote_ranks) == ([2, 3], [])
    internal = parallel("-dp", "4", "-dpl", "2")                # the others join with --headless
    assert (list(internal.served_ranks), internal.remote_ranks) == ([0, 1, 2, 3], [2, 3])


def test_a_headless_engine_cores_config_digest_is_the_servers_unless_an_engine_flag_differs():
    server = EngineArgs.from_cli_args(serve.parse_args(["-dp", "2", "-dpl", "1"])).create_engine_config()
    headless = EngineArgs.from_cli_args(serve.parse_args(["--headless", "-dp", "2", "-dpl", "1", "-dpr", "1",
                                                          "--port", "9"])).create_engine_config()
    other = EngineArgs.from_cli_args(serve.parse_args(["--headless", "-dp", "2", "-dpl", "1", "-dpr", "1",
                                                       "--max-model-len", "1024"])).create_engine_config()
    assert server.compute_hash() == headless.compute_hash() != other.compute_hash()


def test_nnodes_splits_an_engine_cores_ranks_over_machines_in_rank_order_and_bad_layouts_are_refused(capsys):
    p = parallel("-tp", "4", "-pp", "2", "-n", "2", "-r", "0", "--master-addr", "10.0.0.1", "--master-port", "29600")
    assert (p.nnodes, p.node_rank, p.master_addr, p.master_port) == (2, 0, "10.0.0.1", 29600)
    assert p.local_world_size == 4 and list(p.node_ranks(0)) == [0, 1, 2, 3] and list(p.node_ranks(1)) == [4, 5, 6, 7]
    other = parallel("--headless", "-tp", "4", "-pp", "2", "--nnodes", "2", "--node-rank", "1")
    assert (other.node_rank, other.master_addr, other.master_port) == (1, "127.0.0.1", 29501)   # vLLM's defaults
    for argv, words in ((["-tp", "2", "--nnodes", "2", "--node-rank", "1"], "add --headless"),
                        (["--headless", "-tp", "2", "--nnodes", "2"], "give this machine's --node-rank"),
                        (["--headless"], "or some of its worker ranks (give --nnodes")):
        with pytest.raises(SystemExit) as exc:
            serve.parse_args(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and words in err, err
    for kwargs, words in ((dict(tensor_parallel_size=2, nnodes=3), "must evenly divide the ranks"),
                          (dict(tensor_parallel_size=2, nnodes=2, node_rank=2), "node_rank in \\[0, nnodes\\)"),
                          (dict(tensor_parallel_size=2, nnodes=2, data_parallel_size=2), "run whole engine cores"),
                          (dict(tensor_parallel_size=2, nnodes=2, multiprocess=False), "multiprocess layout"),
                          (dict(tensor_parallel_size=2, nnodes=2, master_port=0), "master_port must be in")):
        with pytest.raises(ValueError, match=words):
            EngineArgs(**kwargs).create_engine_config()
    with pytest.raises(ValueError, match="places the ranks itself"):
        EngineArgs(tensor_parallel_size=2, nnodes=2, distributed_executor_backend="ray").create_engine_config()


def test_a_machines_config_digest_counts_the_machines_and_not_its_node_rank():
    def digest(*argv: str) -> str:
        return EngineArgs.from_cli_args(serve.parse_args(list(argv))).create_engine_config().compute_hash()
    leader = digest("-tp", "2", "--nnodes", "2", "--master-addr", "10.0.0.1")
    assert leader == digest("--headless", "-tp", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1")
    assert leader != digest("-tp", "2")


def test_what_the_ranks_and_stages_split_is_accepted():
    spec = {"method": "self_draft", "quantization": "gguf-i8", "num_speculative_tokens": 4}
    for layout in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        EngineArgs(**layout, enable_lora=True).create_engine_config()              # adapters are split
        EngineArgs(**layout, quantization="gguf-i8").create_engine_config()        # so are GGUF blocks
        EngineArgs(**layout, quantization="fp8").create_engine_config()            # and quantized tensors
        EngineArgs(**layout, speculative_config=spec).create_engine_config()       # drafts
        EngineArgs(**layout, speculative_config={"method": "ngram", "num_speculative_tokens": 4,
                                                 "prompt_lookup_max": 4}).create_engine_config()
