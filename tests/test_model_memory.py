"""Memory for models that outgrow a device (trainer/model_memory.py): activation checkpointing and layers built on
the meta device give the same results as without them (to 1e-6), single-process and under fsdp (2 gloo processes),
and every misuse is one clear error. Memory and time: benchmarks/model_memory.py."""
from __future__ import annotations

import pytest
import torch
from memory_tasks import AttentionTask, Block, BlocksTask, ConfiguredTask, ScaledTask
from taskfit import MisconfigurationError, TaskModuleError, Trainer, seed_everything
from taskfit.strategies.fsdp import FSDPStrategy
from tasks import same_state
from torch import nn

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, logger=False, enable_checkpointing=False,
             num_sanity_val_steps=0)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert list(a) == list(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _fit(task_cls=BlocksTask, empty_init=False, steps=6, **trainer_kwargs):
    trainer = Trainer(max_steps=steps, seed=1, **{**QUIET, **trainer_kwargs})
    seed_everything(0)
    with trainer.init_module(empty_init=empty_init):
        task = task_cls()
    trainer.fit(task)
    return task


# ---- activation checkpointing -----------------------------------------------------------------------------------
def test_activation_checkpointing_recomputes_the_chosen_blocks_and_trains_the_same():
    Block.forwards = 0
    plain = _fit()
    assert Block.forwards == 6 * 3  # 6 steps, 3 blocks
    Block.forwards = 0
    checkpointed = _fit(activation_checkpointing={Block})
    assert Block.forwards == 6 * 3 * 2  # each block's forward runs again in the backward
    assert list(checkpointed.state_dict()) == list(plain.state_dict())  # names (and checkpoints) unchanged
    assert _max_diff(checkpointed.state_dict(), plain.state_dict()) <= 1e-6  # dropout drew the same masks


def test_activation_checkpointing_by_import_path_or_function_and_only_the_outermost():
    Block.forwards = 0
    by_path = _fit(activation_checkpointing=["memory_tasks.Block", "torch.nn.Linear"], steps=2)
    assert Block.forwards == 2 * 3 * 2
    assert all(type(b.__dict__.get("forward")).__name__ == "CheckpointedForward" for b in by_path.blocks)
    assert "forward" not in by_path.blocks[0].up.__dict__  # inside a checkpointed block: recomputed anyway
    assert "forward" in by_path.head.__dict__  # a Linear outside the blocks is checkpointed itself
    chosen = _fit(activation_checkpointing=lambda m: m is not None and isinstance(m, nn.Embedding), steps=2)
    assert "forward" in chosen.embed.__dict__ and "forward" not in chosen.blocks[0].__dict__


@pytest.mark.parametrize("policy, message", [
    (True, r"Trainer\(activation_checkpointing=True\) is not valid\.\n  HINT: pass the layer classes"),
    ({int}, r"activation_checkpointing=\{<class 'int'>\}\) is not valid"),
    (["no_such_module.Block"], r"'no_such_module\.Block' is not an importable class\.\n  HINT: give the full import "
                               r"path"),
])
def test_a_bad_activation_checkpointing_policy_is_refused_when_the_trainer_is_built(policy, message):
    with pytest.raises(MisconfigurationError, match=message):
        Trainer(activation_checkpointing=policy)


def test_a_policy_that_picks_nothing_is_an_error_naming_the_layers():
    with pytest.raises(MisconfigurationError, match=r"activation_checkpointing=\{Conv2d\}\) picks no submodule of "
                                                    r"BlocksTask; its layers with parameters are \['Block', "
                                                    r"'Embedding', 'LayerNorm', 'Linear', 'ModuleList'\]\.\n  HINT"):
        _fit(activation_checkpointing={nn.Conv2d}, steps=1)


# ---- meta-device initialisation -----------------------------------------------------------------------------------
def test_init_module_builds_the_layers_empty_and_fit_trains_exactly_what_an_eager_build_trains():
    trainer = Trainer(max_steps=6, seed=1, **QUIET)
    seed_everything(0)
    with trainer.init_module(empty_init=True):
        task = BlocksTask()
    assert all(t.is_meta for t in [*task.parameters(), *task.buffers()])  # no memory for the layers...
    assert not task.data.tensors[0].is_meta  # ...but the data the task made in __init__ is real
    trainer.fit(task)
    eager = _fit()
    assert not any(t.is_meta for t in task.parameters())
    assert _max_diff(task.state_dict(), eager.state_dict()) <= 1e-6


def test_materialised_weights_are_the_eager_ones_for_torch_s_own_layers():
    """Linear, Embedding, LayerNorm and MultiheadAttention (whose init also zeroes its out_proj's bias after that
    Linear's own init): children first, with the random numbers an eager construction draws."""
    from taskfit.strategies.model_memory import materialize

    seed_everything(0)
    eager = AttentionTask()
    after_eager = torch.get_rng_state()
    for draw_in_between in (False, True):
        seed_everything(0)
        with Trainer(**QUIET).init_module(empty_init=True):
            empty = AttentionTask()
        if draw_in_between:
            torch.rand(3)  # (or a seed set): the stream is the caller's, and stays where it is
        before = torch.get_rng_state()
        materialize(empty)
        assert same_state(dict(empty.state_dict()), dict(eager.state_dict()))
        # nothing drawn since the with block: the stream goes on where the eager build left it
        assert torch.equal(torch.get_rng_state(), before if draw_in_between else after_eager)


def test_layers_built_empty_in_configure_model_train_what_an_eager_configure_model_trains():
    def fit(empty: bool) -> ConfiguredTask:
        seed_everything(0)
        task = ConfiguredTask(empty)
        Trainer(max_steps=4, seed=1, **QUIET).fit(task)
        return task

    eager, empty = fit(False), fit(True)
    assert len(empty.blocks) == 3 and not any(t.is_meta for t in empty.parameters())
    assert _max_diff(empty.state_dict(), eager.state_dict()) <= 1e-6


def test_a_layer_without_reset_parameters_cannot_be_built_empty():
    trainer = Trainer(max_steps=1, **QUIET)
    with trainer.init_module(empty_init=True):
        task = ScaledTask()
    with pytest.raises(TaskModuleError, match=r"Scaled was built inside trainer\.init_module\(empty_init=True\), so "
                                              r"its \['scale'\] have no values, and it has no reset_parameters\(\) "
                                              r"to initialise them\.\n  HINT: define Scaled\.reset_parameters\(\)"):
        trainer.fit(task)


def test_empty_init_none_builds_empty_only_under_fsdp():
    with Trainer(**QUIET).init_module():
        assert not next(iter(BlocksTask().parameters())).is_meta
    with Trainer(strategy=FSDPStrategy("cpu", 2), **QUIET).init_module():
        assert next(iter(BlocksTask().parameters())).is_meta
    with Trainer(**QUIET).init_module(empty_init=False):
        assert not next(iter(BlocksTask().parameters())).is_meta


# ---- under fsdp: 2 gloo processes -------------------------------------------------------------------------------
def test_fsdp_with_empty_init_and_activation_checkpointing_trains_what_eager_fsdp_trains():
    """The layers built empty in the parent, materialised and sharded unit by unit in each rank; the transformer
    layers (FSDP units) checkpointed. Rank 0's gathered weights come back to the parent's task."""
    layer = {nn.TransformerEncoderLayer}
    eager = _fit(AttentionTask, strategy=FSDPStrategy("cpu", 2, auto_wrap_policy=layer))
    both = _fit(AttentionTask, empty_init=True, strategy=FSDPStrategy("cpu", 2, auto_wrap_policy=layer),
                activation_checkpointing=layer)
    assert not any(t.is_meta for t in both.parameters())
    assert _max_diff(both.state_dict(), eager.state_dict()) <= 1e-6


def test_ddp_with_empty_init_trains_what_eager_ddp_trains():
    """Each rank materialises the whole task (the same random numbers on every rank); the launcher's empty task
    takes rank 0's weights at the end."""
    ddp = dict(strategy="ddp", accelerator="cpu", devices=2)
    eager, empty = _fit(**ddp), _fit(empty_init=True, **ddp)
    assert not any(t.is_meta for t in empty.parameters())
    assert _max_diff(empty.state_dict(), eager.state_dict()) <= 1e-6
