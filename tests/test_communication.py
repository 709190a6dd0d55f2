"""One vocabulary of gradient communication (dit_lightning/communication.py): the DDP strategy and the
planner take the names and the ``powersgd:R`` parser from it, accept and refuse the same spellings with
the same words, and give FSDP's one answer to PowerSGD."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from dit_lightning import communication as vocabulary
from dit_lightning.communication import FSDP_NO_POWERSGD, parse_communication
from dit_lightning.distributed import DiTDDPStrategy, DiTFSDP2Strategy, DiTFSDPStrategy, strategies
from dit_lightning.distributed import communication as hooks
from dit_lightning.planner import PlanOptions, recommend
from dit_lightning.planner import communication as planned

recommending = importlib.import_module("dit_lightning.planner.recommend")  # (planner.recommend: the function)
SPELLINGS = [
    "none",
    "bf16",
    "FP16",
    " powersgd ",
    "powersgd:2",
    "PowerSGD:1",
    "powersgd:0",
    "powersgd:x",
    "bf16:2",
    "int8",
]


def test_both_sides_read_the_one_home_and_restate_no_name():
    assert planned.parse_communication is parse_communication is recommending.parse_communication
    assert hooks.communication_setting is vocabulary.communication_setting
    names = set(vocabulary.COMMUNICATIONS)
    for module in (hooks, strategies, planned, recommending):
        for node in ast.walk(ast.parse(Path(str(module.__file__)).read_text())):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
                listed = {e.value for e in node.elts if isinstance(e, ast.Constant)}
                assert not names <= listed, f"{module.__name__} restates the communication names"


@pytest.mark.parametrize("spelling", SPELLINGS)
def test_the_strategy_and_the_planner_accept_and_refuse_the_same_spellings(spelling):
    options = PlanOptions(model="DiT-S/2", world_size=2, communication=spelling)
    try:
        plan = planned.plan_communication(options, "a100-80gb")
    except ValueError as planner_said:
        with pytest.raises(ValueError) as strategy_said:
            DiTDDPStrategy(communication=spelling)
        assert str(strategy_said.value) == str(planner_said) and "choose none, bf16, fp16" in str(planner_said)
        return
    strategy = DiTDDPStrategy(communication=spelling)
    kind, _ = parse_communication(spelling)
    assert strategy.communication == kind
    if kind == "powersgd":  # the same rank: the one the spelling names, else the default
        assert f"PowerSGD rank {strategy.powersgd_rank} " in " ".join(plan.notes)


def test_fsdp_answers_powersgd_in_one_text():
    fsdp = PlanOptions(model="DiT-S/2", world_size=2, strategy="fsdp", communication="powersgd")
    with pytest.raises(ValueError, match=re.escape(FSDP_NO_POWERSGD)):
        planned.plan_communication(fsdp, "a100-80gb")
    with pytest.raises(ValueError, match=re.escape(FSDP_NO_POWERSGD)):
        recommend(fsdp, gpu="a100-80gb")
    for fsdp_strategy in (DiTFSDPStrategy, DiTFSDP2Strategy):  # what the CLI says for --trainer.strategy.communication
        assert fsdp_strategy.unknown_option_hints["communication"] == FSDP_NO_POWERSGD
    assert [vocabulary.fsdp_reduce_dtype(c) for c in ("none", "bf16", "fp16")] == ["float32", "bfloat16", "float16"]
