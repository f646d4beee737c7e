import importlib.util
import os

import pytest
import torch

# Tests never reach a model hub: every weight comes from disk or a seed.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Triton kernels run on the CPU only in Triton's interpreter, which triton turns on when it is first
# imported (importing graphexec imports it, through inductor); with no GPU, the suite tests the
# triton attention backend that way (tests/test_triton_attention.py).
if importlib.util.find_spec("triton") is not None and not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Under pytest-xdist (the README's test command: three workers on 2 cores) each worker runs
# single-threaded, its subprocesses too: OpenMP teams of two threads from several processes on two
# cores spin against each other (a busy neighbour makes OpenMP code collapse), where single-threaded
# workers share the cores.  Tests marked `two_threads` (the kernel tests: how at::parallel_for
# splits work between threads is part of what they test) keep two (`_two_threads`).
_XDIST_WORKER = bool(os.environ.get("PYTEST_XDIST_WORKER"))
if _XDIST_WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _two_threads(request):
    if not _XDIST_WORKER or request.node.get_closest_marker("two_threads") is None:
        yield
        return
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(1)


TINY_OVERRIDES = ["model=tiny-llama", "capture=eager", "cache.num_slots=2048"]


# The files that take longest, longest first (measured with the README's command, `--durations`),
# run before the rest: xdist's loadfile hands out whole files in collection order
# (`--no-loadscope-reorder` in pyproject.toml), and a long file handed out last keeps one worker
# busy after the others have finished.  A stale order costs minutes, never a result.
LONGEST_FIRST = (
    "test_aoti_forward.py", "test_fidelity.py", "test_tp_model.py", "test_tp_engine.py", "test_packaging.py",
    "test_capture_plan.py", "test_model_families.py", "test_bench_capture.py", "test_cli.py", "test_bench_serve.py",
    "test_structured_output.py", "test_triton_attention.py", "test_capture_artifacts.py", "test_server_tools.py",
    "test_speculative.py", "test_tc_piecewise.py", "test_sliding_window.py", "test_lm_eval.py", "test_bench.py",
    "test_full_graph.py",
)


def _longest_first(items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: files stay whole


def pytest_collection_modifyitems(config, items):
    import torch

    _longest_first(items)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; this machine has none (run on the lent device)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(scope="session")
def smollm2_engine():
    from graphexec import Engine

    return Engine(overrides=["model=smollm2-135m", "capture=eager", "cache.num_slots=8192"])


@pytest.fixture(scope="session")
def hf_smollm2(tmp_path_factory):
    """transformers' SmolLM2: dequantized once per run, saved where every xdist worker of the run
    finds it (the parent of a worker's base temp dir is the run's)."""
    from tests.reference import hf_smollm2 as load

    base = tmp_path_factory.getbasetemp()
    return load((base.parent if _XDIST_WORKER else base) / "hf-smollm2.pt")


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer():
    """transformers' tokenizer from the same GGUF (reading it costs seconds: once per run)."""
    from tests.reference import hf_smollm2_tokenizer as load

    return load()


@pytest.fixture()
def tiny_engine():
    from graphexec import Engine

    return Engine(overrides=TINY_OVERRIDES)


@pytest.fixture(scope="module")
def tiny():
    """A tiny eager engine with its loop thread, shut down after the module."""
    from graphexec import Engine

    with Engine(overrides=TINY_OVERRIDES) as engine:
        yield engine


@pytest.fixture(scope="module")
def tiny_server(tiny):
    """graphexec-serve's app for `tiny`, on 127.0.0.1 at a free port."""
    from graphexec.server.app import create_app
    from tests.helpers import ServerThread, server_config

    with ServerThread(create_app(tiny, server_config())) as server:
        yield server
