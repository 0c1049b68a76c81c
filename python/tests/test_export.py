"""The exporter's rules on small models (torch on the CPU; the round trips against PyTorch's
saved bytes are tests/models/check_export.py): what each construct becomes, and what it
refuses, all of it in one error."""
from __future__ import annotations

import json
import os

import pytest

torch = pytest.importorskip("torch")
nn = torch.nn
F = torch.nn.functional

from vramscope.export import ExportError, export  # noqa: E402


def layers(model, shape, **kw):
    return export(model, shape, **kw)["layers"]


def test_a_view_that_follows_the_batch_is_written_with_batch():
    class Heads(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(32, 32)

        def forward(self, x):
            h = self.fc(x).view(x.size(0), x.size(1), 4, 8).transpose(1, 2)
            return h.contiguous().view(x.size(0), -1)

    out = layers(Heads(), [3, 5, 32])
    assert [it["type"] for it in out] == ["Linear", "Reshape", "Transpose", "Contiguous", "Flatten"]
    assert out[1]["shape"] == ["batch", 5, 4, 8]
    assert out[2] == {"name": "transpose", "type": "Transpose", "dim0": 1, "dim1": 2}


def test_a_residual_inside_a_forward_is_inline_and_keeps_the_module_names():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(16)
            self.fc = nn.Linear(16, 16)

        def forward(self, x):
            x = x + self.fc(self.norm(x))
            return F.gelu(x)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            return self.head(self.block(x))

    out = layers(Net(), [2, 16])
    block = out[0]
    assert block["name"] == "block" and block["type"] == "Residual" and block["class"] == "Block"
    assert [m["name"] for m in block["body"]] == ["norm", "fc"]
    assert block["then"] == [{"name": "gelu", "type": "GELU"}]
    assert "inline" not in block


def test_two_residuals_in_one_forward_are_inline_in_a_sequential():
    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(8, 8)
            self.b = nn.Linear(8, 8)

        def forward(self, x):
            x = x + self.a(x)
            return x + self.b(x)

    out = layers(nn.Sequential(Layer(), nn.Linear(8, 2)), [2, 8])
    # The root's nn.Sequential children are the top level; the Layer is a block (it forks).
    assert out[0]["type"] == "Sequential" and out[0]["name"] == "0"
    assert [(r["type"], r.get("inline")) for r in out[0]["layers"]] == [("Residual", True), ("Residual", True)]
    assert [r["body"][0]["name"] for r in out[0]["layers"]] == ["a", "b"]


def test_plain_containers_are_expanded_into_the_top_level_sequence():
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))
    out = layers(model, [2, 4])
    assert out[0]["expand"] is True and [m["type"] for m in out[0]["layers"]] == ["Linear", "ReLU"]


def test_frozen_modules_in_place_flags_and_an_activation_called_twice():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Linear(4, 8)
            self.stem.requires_grad_(False)
            self.fc = nn.Linear(8, 8)
            self.act = nn.ReLU(inplace=True)

        def forward(self, x):
            return self.act(self.fc(self.act(self.stem(x))))

    out = layers(Net(), [2, 4])
    assert out[0]["frozen"] is True and "frozen" not in out[2]
    assert out[1] == {"name": "act", "type": "ReLU", "inplace": True}
    assert out[3] == {"use": "act"}


def test_concatenated_branches_are_a_parallel_in_argument_order():
    class Mixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Conv2d(4, 2, 1)
            self.b = nn.Conv2d(4, 6, 3, padding=1)

        def forward(self, x):
            return torch.cat([self.b(x), self.a(x)], 1)

    out = layers(nn.Sequential(Mixed(), nn.Flatten()), [2, 4, 5, 5], loss="sum")
    par = out[0]
    assert par["type"] == "Parallel" and par["join"] == "concat" and "dim" not in par
    assert [b[0]["name"] for b in par["branches"]] == ["b", "a"]


def test_everything_unmappable_is_listed_once_with_its_line():
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            y = self.fc(x)
            y = self.fc(torch.cos(y))
            return torch.sin(y) + 3

    with pytest.raises(ExportError) as e:
        export(Odd(), [2, 8], name="odd")
    text = str(e.value)
    assert "cannot export odd: 4 things" in text
    assert "test_export.py" in text
    for what in ("call_function cos", "called again", "call_function sin", "arithmetic with a number"):
        assert what in text


class _Wavy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return torch.sin(self.fc(x))  # the line a problem inside a submodule names


class _TwoWavy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = _Wavy(), _Wavy()

    def forward(self, x):
        return self.a(x) + self.b(x)


def test_a_problem_inside_a_submodule_names_the_submodules_line_not_the_callers():
    import inspect
    line = inspect.getsourcelines(_Wavy.forward)[1] + 1
    with pytest.raises(ExportError) as e:
        export(_TwoWavy(), [2, 8], name="two")
    text = str(e.value)
    assert "in 'a' (" in text and f"test_export.py:{line})" in text, text
    assert f"test_export.py:{line + 9})" not in text  # _TwoWavy.forward's line


def test_an_operator_that_needs_values_is_named_with_its_place(tmp_path, capsys):
    from vramscope.export.__main__ import main
    (tmp_path / "m.py").write_text(
        "import torch\nimport torch.nn as nn\n\n"
        "class Pick(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(8, 8)\n\n"
        "    def forward(self, x):\n        y = self.fc(x)\n        return y[torch.nonzero(y > 0)[:, 0]]\n")
    assert main([f"{tmp_path / 'm.py'}:Pick", "--input", "4,8", "--level", "ops"]) == 2
    err = capsys.readouterr().err
    assert "nonzero (in the model, m.py:11 (forward)): its output's size depends on the tensor's values" in err, err
    assert "Traceback" not in err


def test_a_graph_that_is_not_series_parallel_is_refused():
    class Dense(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.Linear(4, 4)
            self.b = nn.Linear(4, 4)

        def forward(self, x):
            a = self.a(x)
            b = self.b(a)
            return torch.cat([a, b, x], 1)  # a is both a branch and a step of another

    with pytest.raises(ExportError, match="not series-parallel"):
        export(Dense(), [2, 4])


@pytest.mark.parametrize("shape, kw, message", [
    ([0, 4], {}, "expected positive sizes"),
    ([2, 4], {"loss": "hinge"}, "expected one of"),
    ([2, 4], {"loss": "none"}, "returns its loss"),
    ([2, 4], {"input_dtype": "int64"}, "needs an nn.Embedding"),
    ([2, 5], {}, "does not run on an input of shape [2, 5]"),
])
def test_bad_requests_are_refused(shape, kw, message):
    with pytest.raises(ExportError) as e:
        export(nn.Linear(4, 3), shape, **kw)
    assert message in str(e.value)


def test_the_users_model_is_left_untouched():
    model = nn.Linear(4, 3)
    weight = model.weight.detach().clone()
    export(model, [2, 4])
    assert model.weight.device.type == "cpu" and torch.equal(model.weight.detach(), weight)


@pytest.mark.parametrize("args, message", [
    (["no_such_file.py:make", "--input", "2,4"], "no_such_file.py: no such file"),
    (["make_model", "--input", "2,4"], "expected FILE.py:FUNCTION"),
    (["{model}:missing", "--input", "2,4"], "has no 'missing'"),
    (["{model}:NOT_CALLABLE", "--input", "2,4"], "is not callable"),
    (["{model}:broken", "--input", "2,4"], "building the model failed"),
    (["{model}:make", "--input", "2,x"], "expected sizes separated by commas"),
    (["{model}:make", "--input", "2,4", "-o", "/no/such/dir/net.json"], "cannot write /no/such/dir/net.json"),
])
def test_the_command_refuses_bad_arguments_with_exit_2(tmp_path, capsys, args, message):
    from vramscope.export.__main__ import main
    model = tmp_path / "my_model.py"
    model.write_text("import torch\nNOT_CALLABLE = 3\n"
                     "def make():\n    return torch.nn.Sequential(torch.nn.Linear(4, 3))\n"
                     "def broken():\n    raise ValueError('no weights here')\n")
    assert main([a.replace("{model}", str(model)) for a in args]) == 2
    assert message in capsys.readouterr().err


def test_the_command_writes_the_file_and_says_what_it_is(tmp_path, capsys):
    from vramscope.export.__main__ import main
    model = tmp_path / "my_model.py"
    model.write_text("import torch\ndef make():\n    return torch.nn.Sequential(torch.nn.Linear(4, 3))\n")
    out = tmp_path / "net.json"
    assert main([f"{model}:make", "--input", "2,4", "-o", str(out)]) == 0
    assert capsys.readouterr().err.strip() == (f"{out}: make, 15 parameters, 1 top-level module, input [batch, 4] "
                                               "with batch 2, cross_entropy over 3 classes")
    assert '"type": "Linear"' in out.read_text()


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return x + F.gelu(self.fc(x))


def test_checkpointed_modules_keep_their_checkpoint():
    from torch.utils.checkpoint import checkpoint

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = nn.Sequential(_Block(), _Block(), _Block())
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            x = checkpoint(self.blocks[0], x, use_reentrant=False)
            x = checkpoint(self.blocks[1].forward, x)  # use_reentrant unset: PyTorch's default, reentrant
            return self.head(self.blocks[2](x))

    out = layers(Net(), [2, 8])
    blocks = out[0]["layers"]
    assert [b.get("checkpoint") for b in blocks] == [True, "reentrant", None]
    assert [b["body"][0]["name"] for b in blocks] == ["fc", "fc", "fc"]  # traced through


def test_checkpoint_sequential_inside_forward_is_refused():
    import torch.utils.checkpoint as cp

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.seq = nn.Sequential(nn.Linear(8, 8), nn.ReLU())

        def forward(self, x):
            return cp.checkpoint_sequential(self.seq, 2, x)

    with pytest.raises(ExportError) as e:
        export(Net(), [2, 8])
    text = str(e.value)
    assert "checkpoint_sequential inside forward" in text
    assert text.count("test_export.py") == 1
    assert cp.checkpoint.__module__ == "torch.utils.checkpoint" and cp.checkpoint.__name__ == "checkpoint"


class _Forum(nn.Module):
    """A forum user's network: `x = checkpoint(self.block1, x)` of a method that calls two
    convs, then `checkpoint(F.relu, x)`."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.conv3 = nn.Conv2d(8, 8, 3, padding=1)
        self.head = nn.Linear(8 * 8 * 8, 2)

    def block1(self, x):
        return self.conv2(F.relu(self.conv1(x)))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        x = checkpoint(self.block1, x, use_reentrant=False)
        x = checkpoint(F.relu, x)  # use_reentrant unset: PyTorch's default, reentrant
        x = checkpoint(lambda t: self.conv3(t), x, use_reentrant=False)
        return self.head(x.flatten(1))


def test_checkpoint_of_a_method_or_a_function_is_an_inline_region():
    out = layers(_Forum(), [2, 3, 8, 8])
    regions = [it for it in out if it.get("type") == "Sequential" and it.get("inline")]
    assert [r["checkpoint"] for r in regions] == [True, "reentrant", True]
    assert [[l.get("name") or l.get("use") for l in r["layers"]] for r in regions] == \
        [["conv1", "relu", "conv2"], ["relu_1"], ["conv3"]]  # fx names the second F.relu relu_1
    assert "name" not in regions[0]  # code of forward: no name of its own
    assert out[-1]["name"] == "head"


def test_an_exported_inline_region_loads_and_keeps_only_its_input(tmp_path):
    import json
    import subprocess
    from conftest import vramscope_command
    exe = vramscope_command()
    if exe is None:
        pytest.skip("no vramscope command (VRAMSCOPE_BUILD_DIR, or the installed package's)")
    doc = export(_Forum(), [2, 3, 8, 8])
    path = tmp_path / "forum.json"
    path.write_text(json.dumps(doc))
    saved = tmp_path / "saved.csv"
    done = subprocess.run([exe, "trace", "--model-file", str(path), "--batch", "2", "--saved", str(saved),
                           "--no-pre", "--max-depth", "1"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    rows = saved.read_text().splitlines()
    # Everything inside the regions reruns in backward: nothing of conv1, relu or conv2 is
    # saved in the first forward; the head keeps its input.
    modules = {r.split(",")[0] for r in rows[1:]}
    assert "head" in modules and not modules & {"conv1", "relu", "conv2", "conv3"}, rows


def test_a_module_list_iterated_in_forward_is_a_container_of_its_elements():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = nn.ModuleList([_Block() for _ in range(3)])
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return self.head(x)

    out = layers(Net(), [2, 8])
    assert out[0]["name"] == "layers" and out[0]["expand"] is True
    assert [b["name"] for b in out[0]["layers"]] == ["0", "1", "2"]
    assert all(b["type"] == "Residual" and b["class"] == "_Block" for b in out[0]["layers"])


def test_a_tensor_times_or_over_a_number_is_a_scale():
    import math

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            x = self.fc(x) * 0.5
            return torch.mul(x / math.sqrt(16), 3)

    out = layers(Net(), [2, 8])
    assert [it["type"] for it in out] == ["Linear", "Scale", "Scale", "Scale"]
    assert [it["factor"] for it in out[1:]] == [0.5, 0.25, 3.0]


def test_softmax_without_a_dim_follows_pytorchs_legacy_choice():
    # nn.Softmax() on [N, C] normalises dim 1 (the last): mapped; on [N, C, H, W] dim 1 (not the last): refused.
    assert layers(nn.Sequential(nn.Linear(4, 3), nn.Softmax()), [2, 4], loss="sum")[1] == \
        {"name": "1", "type": "Softmax", "dim": -1}
    with pytest.raises(ExportError, match="softmax over a dimension other than the last"):
        export(nn.Sequential(nn.Conv2d(3, 4, 1), nn.Softmax()), [2, 3, 5, 5], loss="sum")


def test_the_installed_stack_is_a_spec_the_command_reads():
    from vramscope import installed_stack
    spec = installed_stack()
    version = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    assert spec.split(",")[0] == f"torch={version}"
    assert all(part.split("=")[0] in ("torch", "transformers", "peft") for part in spec.split(","))


def test_a_module_whose_forward_is_one_checkpointed_call_stays_a_sequential():
    from torch.utils.checkpoint import checkpoint

    class Inner(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def _run(self, x):
            return F.relu(self.fc(x))

        def forward(self, x):
            return checkpoint(self._run, x, use_reentrant=False)

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = Inner()
            self.head = nn.Linear(8, 2)

        def forward(self, x):
            return self.head(self.inner(x))

    out = layers(Net(), [2, 8])
    inner = next(it for it in out if it.get("name") == "inner")
    assert inner["type"] == "Sequential" and "class" not in inner
    assert inner["layers"][0]["type"] == "Sequential" and inner["layers"][0]["inline"] is True


# The command on what users get wrong: exit 2 and at most two lines, `vramscope.export: ...`,
# never a traceback (torch.fx's own included).
_USER_MODULE = '''\
import sys
import torch
import torch.nn as nn

def make():
    return nn.Sequential(nn.Linear(8, 4))

def conv2d():
    return nn.Sequential(nn.Conv2d(3, 4, 3))

def conv3d():
    return nn.Sequential(nn.Conv3d(3, 4, 3))

def embedding():
    return nn.Sequential(nn.Embedding(10, 8), nn.Linear(8, 2))

def exits():
    sys.exit(3)

def empty():
    return nn.Sequential()

def zero():
    return nn.Sequential(nn.Linear(8, 0))

class NoForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

class Outer(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = NoForward()

    def forward(self, x):
        return self.inner(x)

class Raises(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        raise ValueError("no forward for you")

class ExitsInForward(Raises):
    def forward(self, x):
        sys.exit(4)

class FixedBatch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        return self.fc(x).view(2, 8)
'''


def _at(code: str) -> str:
    """user_model.py:LINE of a line of _USER_MODULE."""
    return f"user_model.py:{next(i for i, l in enumerate(_USER_MODULE.splitlines(), 1) if code in l)}"


def _refused(capsys, args, tmp_path):
    from vramscope.export.__main__ import main
    (tmp_path / "user_model.py").write_text(_USER_MODULE)
    (tmp_path / "raises_at_import.py").write_text("import torch\nraise RuntimeError('no GPU here')\n")
    (tmp_path / "bad_syntax.py").write_text("import torch\n\ndef make(:\n    pass\n")
    (tmp_path / "exits_at_import.py").write_text("import sys\nsys.exit(5)\n")
    # The layer form's messages (the default, --level auto, records operators where it can).
    code = main([a.replace("{dir}", str(tmp_path)) for a in args] + ["--level", "layers"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.startswith("vramscope.export: ") and len(err.strip().splitlines()) <= 2, err
    assert "Traceback" not in err and "ShapeProp" not in err and 'File "' not in err, err
    return err


@pytest.mark.parametrize("args, wanted", [
    # The model argument: a file that fails to import, a module that is not there, an empty part.
    (["{dir}/raises_at_import.py:make"], ["importing", "raises_at_import.py failed",
                                          "raises_at_import.py:2", "RuntimeError: no GPU here"]),
    (["{dir}/bad_syntax.py:make"], ["bad_syntax.py failed", "bad_syntax.py:3: SyntaxError"]),
    (["{dir}/exits_at_import.py:make"], ["exits_at_import.py called sys.exit(5) while being imported"]),
    (["nosuchpkg.x:f"], ["no module named 'nosuchpkg'"]),
    ([":make"], ["':make': expected FILE.py:FUNCTION"]),
    (["{dir}/user_model.py:"], ["expected FILE.py:FUNCTION"]),
    # Sizes beyond int64, or beyond any GPU.
    (["{dir}/user_model.py:make", "--input", "99999999999999999999,8"], ["sizes too large"]),
    (["{dir}/user_model.py:make", "--input", "1099511627776,1099511627776"], ["sizes too large"]),
    (["{dir}/user_model.py:make", "--input", "1099511627777,8"], ["sizes too large"]),
    # An input the model does not take: the module, what it takes and what it got.
    (["{dir}/user_model.py:make", "--input", "2,5"],
     # (torch 1.x also names the line that built the module, between the two)
     ["does not run on an input of shape [2, 5]", "module '0' (Linear)",
      "takes [..., 8] (in_features 8), not float32 [2, 5]"]),
    (["{dir}/user_model.py:conv2d", "--input", "2,8"], ["module '0' (Conv2d)", "takes [N, 3, H, W]"]),
    (["{dir}/user_model.py:conv3d", "--input", "2,3,8,8"],
     ["module '0' (Conv3d, which has no model-file layer)", "takes [N, 3, D, H, W]"]),
    (["{dir}/user_model.py:embedding", "--input", "2,8"], ["int64 token ids below 10 (--input-dtype int64)"]),
    (["{dir}/user_model.py:FixedBatch"], ["runs on an input of shape [2, 8] but not with a batch of 3",
                                          _at("view(2, 8)")]),
    # The user's code exits or raises.
    (["{dir}/user_model.py:exits"], ["user_model.py:exits called sys.exit(3) while building the model",
                                     _at("sys.exit(3)")]),
    (["{dir}/user_model.py:ExitsInForward"], ["forward called sys.exit(4)", _at("sys.exit(4)")]),
    (["{dir}/user_model.py:Raises"], [_at("raise ValueError"), "ValueError: no forward for you"]),
    # Nothing a model file can hold.
    (["{dir}/user_model.py:empty"], ["the model has no layers"]),
    (["{dir}/user_model.py:zero"], ["module '0'", "Linear: a parameter of shape [0, 8]: a layer with a zero dimension"]),
    (["{dir}/user_model.py:NoForward"], ["NoForward has no forward()"]),
    (["{dir}/user_model.py:Outer"], ["module 'inner' (NoForward) is called but has no forward()"]),
], ids=["import-raises", "syntax-error", "import-exits", "no-module", "no-file-part", "no-function-part",
        "size-over-int64", "elements-over-int64", "size-over-2**40", "linear-shape", "conv-rank", "conv3d-rank",
        "embedding-float", "fixed-batch", "factory-exits", "forward-exits", "forward-raises", "empty-sequential",
        "zero-linear", "no-forward", "child-without-forward"])
def test_the_command_reports_what_went_wrong_in_two_lines(tmp_path, capsys, args, wanted):
    if "--input" not in args:
        args = args + ["--input", "2,8"]
    err = _refused(capsys, args + ["-o", str(tmp_path / "never.json")], tmp_path)
    for w in wanted:
        assert w in err, err
    assert not (tmp_path / "never.json").exists()


def test_a_zero_dimension_is_named_where_it_first_appears():
    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return F.relu(self.fc(x)[:, :0]).flatten(1)

    with pytest.raises(ExportError) as e:
        export(Net(), [2, 8], loss="sum")
    assert e.value.problems == [e.value.problems[0]] and "returns a tensor of shape [2, 0]" in e.value.problems[0]


def test_the_output_is_never_the_models_own_source(tmp_path, capsys):
    from vramscope.export.__main__ import main
    victim = tmp_path / "victim.py"
    text = "import torch.nn as nn\n\ndef net():\n    return nn.Sequential(nn.Linear(8, 8))\n"
    victim.write_text(text)
    assert main([f"{victim}:net", "--input", "4,8", "-o", str(victim)]) == 2
    assert "is the model's own source" in capsys.readouterr().err
    assert victim.read_text() == text


@pytest.mark.parametrize("args, wanted", [
    (["--input", "-1,8"], "expected positive sizes"),
    (["--input", "4,8", "--name", "a\x1b[31mb"], "expected 1 to 200 printable characters"),
])
def test_bad_options_are_one_line(tmp_path, capsys, args, wanted):
    from vramscope.export.__main__ import main
    (tmp_path / "m.py").write_text("import torch.nn as nn\n\ndef net():\n    return nn.Sequential(nn.Linear(8, 8))\n")
    assert main([f"{tmp_path / 'm.py'}:net", *args, "-o", str(tmp_path / "out.json")]) == 2
    err = capsys.readouterr().err
    assert wanted in err and len(err.strip().splitlines()) <= 2 and "usage:" not in err, err


def test_a_model_the_layers_cannot_hold_is_recorded_as_operators(tmp_path, capsys):
    from vramscope.export.__main__ import main
    (tmp_path / "m.py").write_text(
        "import torch\nimport torch.nn as nn\n\n"
        "class Gate(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n        self.fc = nn.Linear(8, 8)\n"
        "        self.scale = nn.Parameter(torch.ones(8))\n\n"
        "    def forward(self, x):\n        return torch.sin(self.fc(x)) * self.scale\n")
    out = tmp_path / "gate.json"
    assert main([f"{tmp_path / 'm.py'}:Gate", "--input", "4,8", "--loss", "sum", "-o", str(out)]) == 0
    doc = json.loads(out.read_text())
    ops = [op["op"] for op in doc["graph"]["ops"]]
    assert "aten.sin.default" in ops and doc["options"] == {"batch": 4}
    assert doc["graph"]["tensors"][doc["graph"]["inputs"][0]]["shape"] == ["batch", 8]
    sin = next(op for op in doc["graph"]["ops"] if op["op"] == "aten.sin.default")
    assert sin["node"] == "SinBackward0" and sin["saves"] == sin["in"]  # sin keeps its input


def test_amp_records_autocasts_casts_and_dtypes(tmp_path, capsys):
    from vramscope.export.__main__ import main
    (tmp_path / "m.py").write_text(
        "import torch\nimport torch.nn as nn\n\n"
        "def net():\n    return nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 4))\n")
    out = tmp_path / "amp.json"
    assert main([f"{tmp_path / 'm.py'}:net", "--input", "4,8", "--amp", "bf16", "-o", str(out)]) == 0
    graph = json.loads(out.read_text())["graph"]
    assert graph["autocast"] == "bf16"
    tensors, ops = graph["tensors"], graph["ops"]
    # The weights stay in the run's dtype (f32 under amp); autocast casts them, once, into its cache.
    assert {t["dtype"] for t in tensors if t["kind"] == "param"} == {"float"}
    casts = [op for op in ops if op.get("args", {}).get("autocast_cache")]
    assert sorted(tensors[op["in"][0]]["name"] for op in casts) == ["0.bias", "0.weight", "2.bias", "2.weight"]
    assert all(tensors[op["out"][0]]["dtype"] == "bf16" for op in casts)
    # The cache holds them: the recording never frees them.
    freed = {t for op in ops for t in op.get("frees", [])} | {t for op in ops for _, t in op.get("frees_after", [])}
    assert not freed & {op["out"][0] for op in casts}
    # CUDA autocast's lists: addmm in bf16, layer_norm in f32 (autocast_mode.cpp).
    dtype_of = {op["op"]: tensors[op["out"][0]]["dtype"] for op in ops}
    assert dtype_of["aten.addmm.default"] == "bf16" and dtype_of["aten.native_layer_norm.default"] == "float"
    # The layer form runs under any --dtype: --amp there is refused, not ignored.
    assert main([f"{tmp_path / 'm.py'}:net", "--input", "4,8", "--amp", "bf16", "--level", "layers"]) == 2
    assert "--amp records operators" in capsys.readouterr().err


def test_a_model_that_reads_values_while_built_is_built_on_the_cpu(tmp_path, capsys):
    from vramscope.export.__main__ import main
    (tmp_path / "m.py").write_text(
        "import torch\nimport torch.nn as nn\n\n"
        "class NeedsValues(nn.Module):\n"
        "    def __init__(self):\n        super().__init__()\n"
        "        widths = torch.tensor([8, 16]).tolist()  # regnet does this: no values on meta\n"
        "        self.a = nn.Linear(widths[0], widths[1])\n\n"
        "    def forward(self, x):\n        return self.a(x)\n")
    assert main([f"{tmp_path / 'm.py'}:NeedsValues", "--input", "4,8", "-o", str(tmp_path / "nv.json")]) == 0
    assert "144 parameters" in capsys.readouterr().err


def test_sys_exit_in_the_model_file_is_exit_2_not_its_status(tmp_path):
    import subprocess
    import sys
    (tmp_path / "user_model.py").write_text(_USER_MODULE)
    from conftest import package_env
    env = package_env()
    done = subprocess.run([sys.executable, "-m", "vramscope.export", f"{tmp_path}/user_model.py:exits",
                           "--input", "2,8"], capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.splitlines()[0] == f"vramscope.export: {tmp_path}/user_model.py:exits called sys.exit(3) " \
                                          "while building the model:"


def test_debug_lets_the_users_exception_through(tmp_path, monkeypatch):
    from vramscope.export.__main__ import main
    (tmp_path / "raises_at_import.py").write_text("raise RuntimeError('no GPU here')\n")
    monkeypatch.setenv("VRAMSCOPE_EXPORT_DEBUG", "1")
    with pytest.raises(RuntimeError, match="no GPU here"):
        main([f"{tmp_path}/raises_at_import.py:make", "--input", "2,8"])


def test_a_bug_of_the_exporter_is_one_line_too(tmp_path, capsys, monkeypatch):
    import vramscope.export.__main__ as cli
    (tmp_path / "user_model.py").write_text(_USER_MODULE)

    def broken(*args, **kwargs):
        raise KeyError("layers")

    monkeypatch.setattr(cli, "export", broken)
    assert cli.main([f"{tmp_path}/user_model.py:make", "--input", "2,8"]) == 2
    err = capsys.readouterr().err
    assert err == "vramscope.export: internal error: KeyError: 'layers' (VRAMSCOPE_EXPORT_DEBUG=1 shows the " \
                  "traceback; please report it)\n"


TINY_LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256, "max_position_embeddings": 256}


def _hf_config(tmp_path):
    pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(TINY_LLAMA))
    return str(path)


def test_an_hf_config_under_autocast_runs_attention_in_the_half_type_without_a_mask(tmp_path):
    from vramscope.export import export_hf_config
    graph = export_hf_config(_hf_config(tmp_path), batch=2, seq=16, amp="bf16")["graph"]
    tensors = graph["tensors"]
    attention = [op for op in graph["ops"] if "scaled_dot_product" in op["op"]]
    assert len(attention) == 2
    for op in attention:
        # q, k, v cast to bf16 by autocast's rule; no mask: a CUDA run takes is_causal (transformers
        # would build one for what it takes for tracing).
        assert [tensors[t]["dtype"] for t in op["in"]] == ["bf16"] * 3, op
        assert op["args"].get("is_causal") is True
    assert {tensors[t]["dtype"] for t in graph["inputs"]} == {"i64"}
    assert {t["dtype"] for t in tensors if t["kind"] == "param"} == {"float"}  # f32 weights under amp


def test_lora_freezes_the_base_and_adds_f32_adapters_on_the_targets(tmp_path, capsys):
    pytest.importorskip("peft")
    from vramscope.export import export_hf_config
    from vramscope.export.__main__ import main
    graph = export_hf_config(_hf_config(tmp_path), batch=2, seq=16, lora=4)["graph"]
    trained = [t["name"] for t in graph["tensors"] if t["kind"] == "param" and t.get("requires_grad")]
    assert len(trained) == 2 * 2 * 2 and all(".lora_A." in n or ".lora_B." in n for n in trained), trained
    assert all(n.split(".lora_")[0].endswith(("q_proj", "v_proj")) for n in trained)  # PEFT's default for llama
    assert {t["dtype"] for t in graph["tensors"] if t.get("name") in trained} == {"f32"}  # beside bf16 ("float") weights
    # --lora belongs to --hf-config: a model of one's own takes PEFT in its factory.
    (tmp_path / "m.py").write_text("import torch.nn as nn\n\ndef net():\n    return nn.Linear(8, 8)\n")
    assert main([f"{tmp_path / 'm.py'}:net", "--input", "4,8", "--lora", "4"]) == 2
    assert "--lora applies to --hf-config" in capsys.readouterr().err


def test_gradient_checkpointing_marks_every_decoder_layer_with_its_positional_input(tmp_path):
    from vramscope.export import export_hf_config
    graph = export_hf_config(_hf_config(tmp_path), batch=2, seq=16, gradient_checkpointing="reentrant")["graph"]
    marked = [c for c in graph["calls"] if c.get("checkpoint")]
    assert [c["module"] for c in marked] == ["model.layers.0", "model.layers.1"]
    assert all(c["checkpoint"] == "reentrant" and len(c["args"]) == 1 for c in marked)  # hidden_states only
    with pytest.raises(ExportError):
        export_hf_config(_hf_config(tmp_path), gradient_checkpointing="sideways")
