"""The metric knobs have one home (dit_lightning/evaluation/options.py, MetricOptions): `evaluate` and
the `test` stage's GenerationMetrics take its fields as the same flat flags, with the same defaults,
and refuse the same settings with the same words before any sampling."""

from __future__ import annotations

import dataclasses
import inspect

import pytest
from jsonargparse import ArgumentParser
from lightning.pytorch.cli import LightningArgumentParser

from dit_lightning.callbacks import GenerationMetrics
from dit_lightning.commands.evaluate import evaluate
from dit_lightning.evaluation import MetricOptions, metric_names
from dit_lightning.sampling import SAMPLING_OPTION_NAMES, SamplingOptions

KNOBS = [f.name for f in dataclasses.fields(MetricOptions) if f.name not in SAMPLING_OPTION_NAMES]


def test_both_take_the_knobs_from_the_one_options_object_as_the_same_flat_flags():
    assert {"num_samples", "reference", "inception_weights", "labels", "kid_subset_size"} <= set(KNOBS)
    for taker in (evaluate, GenerationMetrics):  # the knobs are not restated in a signature
        assert not set(KNOBS) & set(inspect.signature(taker).parameters), taker
    tool = ArgumentParser(exit_on_error=False)
    tool.add_function_arguments(evaluate)
    callback = LightningArgumentParser(exit_on_error=False)
    callback.add_lightning_class_args(GenerationMetrics, "evaluation")  # as the CLI does
    given = ["--num_samples", "12", "--reference", "ref.npz", "--kid_subset_size", "5", "--labels", "0-9"]
    cfg = tool.parse_args(["--checkpoint", "c.pt", "--output", "out", *given, "--cfg_scale", "2"])
    test_cfg = callback.parse_args([g.replace("--", "--evaluation.") for g in given] + ["--evaluation.cfg_scale", "2"])
    for name in KNOBS:  # same defaults, same values
        assert cfg[name] == test_cfg.evaluation[name], name
    measured = GenerationMetrics(**test_cfg.evaluation.as_dict()).measured
    assert measured == MetricOptions(**{k: cfg[k] for k in (*KNOBS, *SAMPLING_OPTION_NAMES)})
    assert measured.sampling == SamplingOptions(cfg_scale=2.0) and type(measured.sampling) is SamplingOptions


@pytest.mark.parametrize(
    "settings, metrics, error, match",
    [
        ({}, ["fid"], ValueError, "FID and KID need a reference"),
        ({"reference": "missing-reference"}, ["digits", "fid"], FileNotFoundError, "missing-reference does not exist"),
        ({"num_samples": 1}, ["digits"], ValueError, "num_samples must be at least 2"),
        ({}, ["digits", "fd"], ValueError, r"unknown metrics \['fd'\]: choose from fid, is, kid, digits"),
    ],
)
def test_both_refuse_the_same_settings_before_sampling(tmp_path, settings, metrics, error, match):
    with pytest.raises(error, match=match):
        MetricOptions(**settings).check(metrics)
    with pytest.raises(error, match=match):  # evaluate: before it reads the checkpoint
        evaluate("no-such.ckpt", str(tmp_path / "out"), metrics=",".join(metrics), **settings)
    assert not (tmp_path / "out").exists()
    with pytest.raises(error, match=match):  # the test stage: in setup (or at once for a name)
        GenerationMetrics(metrics=metrics, **settings).measured.check(metrics)
    assert metric_names("FID, is") == ["fid", "is"]
