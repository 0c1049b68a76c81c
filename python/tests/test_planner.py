"""vramscope.estimate, sweep, max_batch and plan: the command's answers from Python, through the
planner library (libvramscope_planner.so), equal to `vramscope ... --format json` bit for bit."""
from __future__ import annotations

import json
import subprocess

import pytest

import vramscope
from conftest import vramscope_command
from vramscope._planner import UsageError

SOURCE = __import__("pathlib").Path(__file__).resolve().parents[2]
CHAIN = SOURCE / "tests" / "data" / "plan-chain.json"


def command_json(*args):
    exe = vramscope_command()
    if exe is None:
        pytest.skip("no vramscope command to compare with")
    done = subprocess.run([exe, *args, "--format", "json"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def same_rows(ours, theirs):
    """Every figure equal; step_ms is the host's time, not a figure of the model."""
    strip = lambda r: {k: v for k, v in r.items() if k != "step_ms"}  # noqa: E731
    assert [strip(r) for r in ours] == [strip(r) for r in theirs]


def test_estimate_is_the_commands_row():
    r = vramscope.estimate("resnet18", batch=32, device="sim:h100-80g", dtype="amp")
    theirs = command_json("sweep", "--model", "resnet18", "--batch", "32", "--device", "sim:h100-80g", "--dtype",
                          "amp", "--segments", "0")
    same_rows([r.row], theirs["rows"])
    assert r.nvidia_smi == r.max_nvidia_smi >= r.max_reserved >= r.max_allocated > 0
    assert r.fits and sum(r.peak.values()) == r.max_allocated
    assert "max allocated" in r._repr_html_() and "activations" in r._repr_html_()


def test_offloading_activations_moves_them_to_pinned_host_memory():
    # offload="activations" is the command's --offload: save_on_cpu around the forward.
    plain = vramscope.estimate("resnet18", batch=32, device="sim:h100-80g")
    offloaded = vramscope.estimate("resnet18", batch=32, device="sim:h100-80g", offload="activations")
    assert plain.pinned_host == 0 < offloaded.pinned_host
    assert offloaded.max_allocated < plain.max_allocated


def test_modules_are_the_trace_of_the_same_configuration(tmp_path):
    r = vramscope.estimate("resnet18", batch=32, device="sim:h100-80g", dtype="amp", steps=3)
    # The same configuration traced: the same peaks, and its log is trace --log's, line for line.
    assert (r.trace["max_allocated"], r.trace["max_reserved"], r.trace["max_nvidia_smi"]) == \
        (r.max_allocated, r.max_reserved, r.nvidia_smi)
    exe = vramscope_command()
    if exe is None:
        pytest.skip("no vramscope command to compare with")
    log = tmp_path / "log.json"
    done = subprocess.run([exe, "trace", "--model", "resnet18", "--batch", "32", "--device", "sim:h100-80g",
                           "--dtype", "amp", "--segments", "0", "--steps", "3", "--log", str(log)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert r.modules == json.loads(log.read_text())["lines"]
    assert {"hook", "module", "type", "allocated", "peak_between"} <= set(r.modules[0])
    assert any(line["module"] == "layer4.1.conv2" and line["type"] == "Conv2d" for line in r.modules)
    # The curve is trace --plot's SVG, and the notebook shows it under the figures.
    assert r.plot.startswith("<svg") or r.plot.startswith("<?xml")
    assert "<svg" in r._repr_html_()
    # The printed log is the command's (the files' lines aside).
    assert r.trace["text"].splitlines()[0] == done.stdout.splitlines()[0]


def test_modules_of_a_step_that_runs_out_show_where():
    r = vramscope.estimate("resnet50", batch=256, device="sim:t4", dtype="f32")
    assert not r.fits
    assert "out of memory" in r.trace["failure"] and r.modules  # the log up to the failure


def test_sweep_and_max_batch_are_the_commands():
    told = []
    rows = vramscope.sweep("mlp", depth=8, batch=[256, 512], segments=[0, 2], dtype="f32,f16",
                           progress=lambda done, total, item: told.append((done, total, item)))
    # The runs as they go: 8 rows, each told before it runs, with what runs.
    assert len(told) >= 8 and all(total >= 8 for _, total, _ in told) and "f32" in told[0][2], told
    same_rows([r.row for r in rows], command_json("sweep", "--model", "mlp", "--depth", "8", "--batch", "256,512",
                                                  "--segments", "0,2", "--dtype", "f32,f16")["rows"])
    assert len(rows) == 8 and "<table>" in rows._repr_html_()
    found = vramscope.max_batch("resnet18", device="sim:t4", dtype="amp", segments=[0, 4])
    theirs = command_json("sweep", "--model", "resnet18", "--device", "sim:t4", "--dtype", "amp", "--segments", "0,4",
                          "--max-batch")
    same_rows([r.row for r in found], theirs["rows"])
    assert found[1].max_batch > found[0].max_batch > 0


def test_plan_gives_the_commands_plans_and_code(tmp_path):
    device = "sim:capacity=640MiB,context=0"
    plans = vramscope.plan(str(CHAIN), device=device, headroom=0, search="none")
    code = tmp_path / "plan.py"
    theirs = command_json("plan", "--model-file", str(CHAIN), "--device", device, "--headroom", "0", "--search", "none",
                          "--code", str(code))
    assert [p.row for p in plans] == theirs["plans"] and plans.best.row == theirs["plans"][theirs["best"]]
    assert plans.best.checkpoint_modules == ["b1", "tail.w0"]
    assert plans.best.code == code.read_text()


def test_bad_options_are_refused_in_the_commands_words():
    with pytest.raises(UsageError, match="--batch: -3 is out of range"):
        vramscope.estimate("resnet18", batch=-3)
    with pytest.raises(UsageError, match="plan: give one --batch"):
        vramscope.plan("resnet18", batch=[8, 16])
    with pytest.raises(UsageError, match="estimate takes one"):
        vramscope.estimate("resnet18", dtype=["f32", "f16"])
    with pytest.raises(UsageError, match="nosuchnet"):
        vramscope.estimate("nosuchnet")
    with pytest.raises(UsageError, match="--format: the library returns the JSON document"):
        vramscope.sweep("resnet18", format="csv")
    with pytest.raises(UsageError, match="export options, for an nn.Module"):
        vramscope.estimate("resnet18", loss="mse")
    # The C boundary itself: only sweep, plan and trace, every failure a status and a message.
    from vramscope import _planner
    for args, says in ((["replay", "x.pickle"], "give sweep, trace or plan"), ([], "give sweep, plan or trace"),
                       (["sweep", "--help"], "vramscope sweep --help")):
        with pytest.raises(UsageError, match=says):
            _planner.run(args)


def test_plan_json_with_max_batch_is_one_document():
    """`plan --max-batch --format json` is JSON alone (its sentence belongs to the table), with
    the largest batch and the best plan's code in it, as the library's callers get them."""
    theirs = command_json("plan", "--model-file", str(CHAIN), "--device", "sim:capacity=640MiB,context=0",
                          "--headroom", "0", "--search", "none", "--max-batch")
    ours = vramscope.plan(str(CHAIN), device="sim:capacity=640MiB,context=0", headroom=0, search="none",
                          max_batch=True)
    assert theirs["max_batch"]["largest"] > 0 and theirs["code"]
    assert ours.document["max_batch"] == theirs["max_batch"] and ours.best.code == theirs["code"]


def make_net():
    """Four residual blocks and a head: plan checkpoints blocks of it."""
    torch = pytest.importorskip("torch")

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList(
                torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 64), torch.nn.Tanh())
                for _ in range(4))
            self.head = torch.nn.Linear(64, 10)

        def forward(self, x):
            for block in self.blocks:
                x = x + block(x)
            return self.head(x)

    return torch, Net()


def test_a_module_object_is_exported_and_run_as_the_command_runs_its_file(tmp_path):
    torch, model = make_net()
    from vramscope.export import export_ops, InputSpec
    ours = vramscope.estimate(model, (16384, 64), device="sim:h100-80g")
    file = tmp_path / "net.json"
    file.write_text(json.dumps(export_ops(model, [InputSpec([16384, 64])], name="Net")))
    same_rows([ours.row], command_json("sweep", "--model-file", str(file), "--device", "sim:h100-80g", "--dtype",
                                       "f32", "--segments", "0")["rows"])
    # Example tensors do as shapes (meta tensors too).
    same_rows([vramscope.estimate(model, torch.empty(16384, 64, device="meta"), device="sim:h100-80g").row], [ours.row])
    with pytest.raises(UsageError, match="needs example inputs"):
        vramscope.estimate(model)
    # The exported file lives as long as the estimate: its modules trace that file.
    assert any(line["module"].startswith("blocks.3") for line in ours.modules)


def test_compile_records_the_joint_graph_and_sweeps_the_compiled_step(tmp_path):
    torch, model = make_net()
    from vramscope.export import export_ops, InputSpec
    rows = vramscope.sweep(model, (4096, 64), device="sim:h100-80g", dtype="bf16", segments=0,
                           compile=["eager", True, 0.5, "reduce-overhead"], progress=False)
    assert [r.compile for r in rows] == [None, 1.0, 0.5, 1.0]
    assert [r.cudagraphs for r in rows] == [False, False, False, True]
    assert rows[1].compiled["saved_values"] and rows[2].compiled["saved_bytes"] <= rows[1].compiled["saved_bytes"]
    # CUDA graphs keep the same partition, in a private pool of their own.
    assert rows[3].compiled["saved_values"] == rows[1].compiled["saved_values"]
    assert rows[3].compiled["graph_pool_reserved"] > 0 and rows[1].compiled["graph_pool_reserved"] == 0
    file = tmp_path / "net.json"
    file.write_text(json.dumps(export_ops(model, [InputSpec([4096, 64])], name="Net", compile=True)))
    same_rows([r.row for r in rows], command_json("sweep", "--model-file", str(file), "--device", "sim:h100-80g",
                                                  "--dtype", "bf16", "--segments", "0", "--compile",
                                                  "eager,on,0.5,reduce-overhead")["rows"])


def test_apply_wraps_the_planned_modules_and_keeps_the_gradients():
    torch, model = make_net()
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    plain = model(x).square().sum()
    plain.backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    plans = vramscope.plan(model, (262144, 64), device="sim:capacity=1000MiB,context=0", search="none")
    assert plans.best is not None and plans.best.checkpoint_modules, [p.row for p in plans]
    made = plans.best.apply(model)
    assert isinstance(made["optimizer"], torch.optim.Optimizer)
    wrapped = {n for n, m in model.named_modules() if type(m).__name__ == "CheckpointWrapper"}
    assert wrapped == set(plans.best.checkpoint_modules)
    again = model(x).square().sum()
    again.backward()
    assert torch.equal(again, plain)
    assert all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), expected))
