"""One import name: taskfit lives beside a user's own ``trainer.py`` and ``callbacks.py`` (and other packages'
``trainer``/``callbacks``), and no module of it is ever loaded twice under two names."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent('''
    import sys

    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import callbacks  # the user's own modules, next to the script
    import trainer
    from taskfit import TaskModule, Trainer
    from taskfit.callbacks import Callback


    class Task(TaskModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(4, 1)

        def forward(self, x):
            return self.net(x)

        def loss(self, out, y):
            return nn.functional.mse_loss(out, y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def train_dataloader(self):
            x = torch.randn(32, 4)
            return DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)


    class Count(Callback):
        batches = 0

        def on_train_batch_end(self, trainer, task, outputs, batch, batch_idx):
            Count.batches += 1


    metrics = Trainer(max_epochs=2, callbacks=[Count()], default_root_dir="runs").fit(Task())
    assert trainer.WHOSE == "user" and callbacks.WHOSE == "user"
    assert Count.batches == 8 and "train/loss_epoch" in metrics, (Count.batches, metrics)
    # every taskfit module once, under taskfit.*: nothing imported as trainer.* or callbacks.*
    names = [n for n in sys.modules if n.split(".")[0] in ("trainer", "callbacks", "examples", "conf")]
    assert sorted(names) == ["callbacks", "trainer"], names
    print("trained beside the user's trainer.py and callbacks.py")
''')


def test_a_script_beside_its_own_trainer_and_callbacks_modules_trains_through_taskfit(tmp_path):
    (tmp_path / "trainer.py").write_text('WHOSE = "user"\nProgressBar = None\n')
    (tmp_path / "callbacks.py").write_text('WHOSE = "user"\n')  # has no ProgressBar: the old install broke here
    (tmp_path / "train.py").write_text(SCRIPT)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    result = subprocess.run([sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    assert "trained beside the user's trainer.py and callbacks.py" in result.stdout
    assert (tmp_path / "runs" / "version_0" / "checkpoints" / "last.ckpt").is_file()


def test_the_library_imports_only_relatively_or_through_taskfit():
    """No module of the package imports the repository folders' names (``trainer``, ``callbacks``...)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    offenders = []
    for folder in ("trainer", "callbacks", "examples", "benchmarks", "tests"):
        for dirpath, _, files in os.walk(os.path.join(root, folder)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                with open(path, encoding="utf-8") as fh:
                    for number, line in enumerate(fh, 1):
                        stripped = line.strip()
                        if stripped.startswith(("from trainer", "import trainer", "from callbacks", "import callbacks",
                                                "from examples", "import examples")) \
                                and "SCRIPT" not in path and not path.endswith("test_packaging.py"):
                            offenders.append(f"{os.path.relpath(path, root)}:{number}: {stripped}")
    assert not offenders, "\n".join(offenders)


def test_import_taskfit_leaves_the_heavy_parts_of_torch_and_the_loggers_unloaded():
    # torch._dynamo (~1 s) comes with torch.compile or an optimizer's first use, tensorboard and hydra with the code
    # that uses them: `import taskfit` (a CLI's --help, a predict script) pays none of them; FSDP and DCP (~1 s) come
    # with strategy="fsdp" or a sharded checkpoint.
    code = ("import sys, taskfit; print(sorted(m for m in ('torch._dynamo', 'tensorboard', 'hydra', 'torchmetrics', "
            "'mlflow', 'torch.distributed.fsdp', 'torch.distributed.checkpoint') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out
