"""The LightningModule that trains a DiT with the hybrid diffusion loss and an EMA of its weights."""

from __future__ import annotations

import contextlib
import copy
import logging
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, Optional, Union

import lightning as L
import torch
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from lightning.pytorch.utilities.rank_zero import rank_zero_deprecation, rank_zero_info
from torch import Tensor, nn

from .checkpoints import (
    NonFiniteWeightsError,
    check_dit_weights,
    clean_state_dict,
    infer_dit_config,
    load_dit_weights,
    nonfinite_message,
    nonfinite_tensors,
    read_checkpoint,
    sit_output_layout,
    strip_prefix,
)
from .device_memory import forget_failed_pass, free_device_memory, is_out_of_memory
from .diffusion import (
    FlowMatching,
    LossWeighting,
    ObjectiveName,
    ObjectiveSettings,
    PathType,
    Prediction,
    TimeDistribution,
    TrainingObjective,
    build_objective,
    objective_from_record,
)
from .diffusion.gaussian_diffusion import ModelFn
from .distributed.ops import clip_gradients, ema_update_, first_failed_rank, grad_norm, no_sync
from .distributed.sharding import configure_sharding
from .keyed_random import keyed_normal, keyed_uniform, sample_keys
from .latents import LatentTransform, transform_of
from .models import DiT, DiTShape, build_dit, dit_macs, training_flops
from .models.dit import AttentionBackend, CheckpointSpec, MlpKind, NormKind, PosEmbedKind, attention_kernel
from .models.repa import REPAOptions
from .models.repa_head import EncoderIdentity, REPAHead, image_shape_of, repa_head
from .optimizers import configure_training_optimizers, use_fused_adamw
from .precision import compute_dtype, grad_scaler, pending_grad_scale, set_tf32
from .sampling import DIFFUSERS_SAMPLERS, Sampler, SamplingOptions, StepLines, sample_latents, sampling_options
from .vae import DEFAULT_SCALE_FACTOR, decode_latents, is_pixel_space, load_vae

if TYPE_CHECKING:
    from lightning.pytorch.utilities.parsing import AttributeDict

log = logging.getLogger(__name__)
# The EMA copy is in eval mode on purpose (it is never trained); Lightning warns about it.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")


# Fixed keys so that validation sees the same timesteps and noise in every run and epoch.
_VAL_STEP_KEY = -1
_STREAM_T, _STREAM_NOISE, _STREAM_DROP, _STREAM_CLASS_TOKEN = 1, 2, 3, 4
# The weight sets of a Lightning checkpoint: (state-dict prefix, what a message calls them).
_WEIGHT_SETS = (("ema.", "EMA weights"), ("model.", "trained weights"))
# REG's class-token layers of a DiT (models/dit.py): what a checkpoint without REG lacks
_CLASS_TOKEN_LAYERS = ("cls_embedder.", "final_layer.linear_cls.")


class DiTModule(L.LightningModule):
    """Train a DiT on latents (``batch = {"x", "y", "index"}``) with the paper's recipe.

    Args:
        model: a registered name (``"DiT-XL/2"``, ``"DiT-S/2"``...) or ``"custom"``.
        latent_shape: (C, H, W) of the latents; linked from the data module by the CLI.
        num_classes: number of classes; linked from the data module by the CLI.
        depth: number of transformer blocks (overrides the named size).
        hidden_size: width of the residual stream (overrides the named size).
        num_heads: attention heads (overrides the named size).
        patch_size: side of the latent patches (overrides the named size).
        mlp_ratio: MLP width / hidden size (4 in the paper).
        attn_dim: width of q, k, v when it is not hidden_size (head-pruned models).
        learn_sigma: predict the variance too (the hybrid loss); else plain epsilon MSE.
        class_dropout_prob: label dropout for classifier-free guidance.
        qk_norm: LayerNorm on queries and keys (stabilises fp16; not in released weights); RMSNorm
            with ``norm: rmsnorm`` (LightningDiT's ``use_qknorm``).
        norm: the block's norms: "layernorm" (DiT) or "rmsnorm" (LightningDiT); unset: the named
            model's (``LightningDiT-XL/1``: rmsnorm).
        mlp: the feed-forward: "gelu" (DiT) or "swiglu" (LightningDiT: two thirds of the width, three
            matrices); unset: the named model's.
        pos_embed: "sincos" (DiT's fixed embedding) or "rope" (LightningDiT: 2D rotary embedding of q
            and k in every block, on top of the sin-cos one); unset: the named model's.
        wo_shift: adaLN without its shift terms (LightningDiT's option; off in its published model).
        activation_checkpointing: "none", "all", "half", "first:N", "every:K", N or block indices.
        compile: ``torch.compile`` the whole network or each block ("blocks" compiles faster
            and keeps the Python loop, so activation checkpointing still applies per block).
        attention_backend: force an SDPA kernel (``auto`` lets PyTorch choose).
        tf32: allow TF32 matmuls on Ampere+ GPUs (fp32 runs ~2-3x faster, tiny precision cost).
        optimizer: optimiser factory (``OptimizerCallable``); default AdamW(lr=1e-4, betas=(0.9, 0.999),
            weight_decay=0), as the CLI's ``--print_config`` shows.
        lr_scheduler: learning-rate schedule factory (``LRSchedulerCallable``), stepped every optimiser
            step; default :class:`~dit_lightning.schedules.WarmupDecayLR` (warm-up, optional decay).
        fused_optimizer: use the fused AdamW kernel on CUDA ("auto": when compatible, also for an
            AdamW given as ``optimizer`` that leaves ``fused`` unset).
        warmup_steps: deprecated shortcut for ``lr_scheduler: WarmupDecayLR(warmup_steps=N)``.
        ema: keep an exponential moving average of all weights.
        ema_decay: EMA decay per optimiser step (0.9999 in the paper).
        ema_warmup: use ``min(decay, (1 + n) / (10 + n))`` at step n, for short runs.
        eval_weights: weights used by validation/test/sampling: "ema" or "raw".
        noise_schedule: the beta schedule ("linear" in the paper, or "cosine").
        diffusion_steps: the diffusion process's steps (1000 in the paper).
        seed: key of the per-sample timesteps, noise and label dropout.
        init_from: start from a checkpoint (released raw state dict, reference format or
            Lightning); weights only, strict, with a clear error for another architecture (a REG
            run takes one without REG's class-token layers: those start at REG's initialisation).
            Also a diffusers DiT directory or a ``.safetensors`` file (docs/diffusers.md).
        sample_steps: default sampling steps of :meth:`sample` (and of the tools reading the checkpoint).
        sampler: default sampler of :meth:`sample`: "ddpm", "ddim" or a diffusers scheduler
            ("dpm++2m", "unipc", ...; docs/sampling.md).
        cfg_scale: default classifier-free guidance scale of :meth:`sample` (1: none).
        guide_channels: guide only the first N epsilon channels (3: the reference's variant).
        vae: the VAE that decodes latents to images ("none/pixels" for pixel-space stores);
            linked from the data module.
        scale_factor: the latent scale of the store (latents = VAE output x scale); linked from
            the data module and kept in the checkpoint (older readers and the reference export read it).
        latent_transform: the record of the store's latent transform (``pixels``, ``scale`` with a
            shift, ``channel_stats``; docs/data.md), linked from the data module and kept in the
            checkpoint, so :meth:`decode` inverts it anywhere; unset: read from ``vae`` and
            ``scale_factor`` (:attr:`latent_transform`; unknown while neither says).
        objective: "ddpm" (the paper's Gaussian diffusion, epsilon prediction, hybrid loss) or "flow"
            (flow matching with SiT's stochastic interpolants; docs/recipes.md). A flow model
            predicts no variance (``learn_sigma`` is set to false) and samples with the flow
            samplers (a ``sampler`` left at "ddpm" becomes "sde-euler", SiT's published setting).
        path_type: the flow's interpolant: "linear" (SiT's default, x_t = t x + (1 - t) noise),
            "gvp" (sin / cos) or "vp" (the VP-SDE's marginals).
        prediction: what a flow model predicts: "velocity" (SiT's default), "noise" or "score".
        time_distribution: training times of a flow model: "uniform" (SiT) or "logit_normal"
            (the noise level 1 - t is sigmoid(N(time_mean, time_std^2)), SD3's convention).
        time_mean: mean of the logit-normal's normal (positive: noisier times).
        time_std: standard deviation of the logit-normal's normal.
        train_eps: distance of a flow model's training times from 0 and 1; unset: SiT's
            create_transport's (0 for velocity on the linear / GVP paths, 1e-3 for noise or score
            prediction there, 1e-5 on the VP path).
        sample_eps: the same for sampling; unset: SiT's (0 for velocity on linear / GVP, else 1e-3).
        loss_weighting: "none" (the reference's loss); "min_snr" (DDPM: the epsilon MSE times
            min(SNR, min_snr_gamma) / SNR, Hang et al. 2023; the variance's vb term unchanged);
            "velocity" or "likelihood" (flow with noise or score prediction: SiT's weights).
        min_snr_gamma: gamma of min_snr (5 in the paper).
        cosine_loss: add LightningDiT's velocity direction term (``use_cosine_loss``): 1 - the cosine
            of the predicted and the path's velocity over the channels, averaged over positions, to
            the velocity MSE (flow, velocity prediction; docs/recipes.md).
        repa: REPA (representation alignment, docs/recipes.md): ``encoder`` (unset: off), its local
            ``weights``, ``depth`` (8), ``coeff`` (0.5), ``projector_dim`` (2048), ``until_step``
            (HASTE's cut-off of the alignment term), ``class_token_weight`` (REG's class token: 0.03;
            flow objective, velocity prediction). The projector trains with the network and is saved
            in checkpoints, never in exports; the encoder's features come from the store (``extract
            --repa_encoder``) or are computed online.
    """

    def __init__(
        self,
        model: str = "DiT-XL/2",
        latent_shape: Optional[Sequence[int]] = None,
        num_classes: Optional[int] = None,
        depth: Optional[int] = None,
        hidden_size: Optional[int] = None,
        num_heads: Optional[int] = None,
        patch_size: Optional[int] = None,
        mlp_ratio: float = 4.0,
        attn_dim: Optional[int] = None,
        learn_sigma: bool = True,
        class_dropout_prob: float = 0.1,
        qk_norm: bool = False,
        norm: Optional[NormKind] = None,
        mlp: Optional[MlpKind] = None,
        pos_embed: Optional[PosEmbedKind] = None,
        wo_shift: Optional[bool] = None,
        activation_checkpointing: CheckpointSpec = None,
        compile: Literal["none", "model", "blocks"] = "none",
        attention_backend: AttentionBackend = "auto",
        tf32: bool = True,
        optimizer: Optional[OptimizerCallable] = None,
        lr_scheduler: Optional[LRSchedulerCallable] = None,
        fused_optimizer: Union[bool, Literal["auto"]] = "auto",
        warmup_steps: int = 0,
        ema: bool = True,
        ema_decay: float = 0.9999,
        ema_warmup: bool = False,
        eval_weights: Literal["ema", "raw"] = "ema",
        noise_schedule: Literal["linear", "cosine"] = "linear",
        diffusion_steps: int = 1000,
        seed: int = 0,
        init_from: Optional[str] = None,
        sample_steps: int = 250,
        sampler: Sampler = "ddpm",
        cfg_scale: float = 1.0,
        guide_channels: Optional[int] = None,
        vae: Optional[str] = None,
        scale_factor: Optional[float] = None,
        latent_transform: Optional[dict[str, Any]] = None,
        objective: ObjectiveName = "ddpm",
        path_type: PathType = "linear",
        prediction: Prediction = "velocity",
        time_distribution: TimeDistribution = "uniform",
        time_mean: float = 0.0,
        time_std: float = 1.0,
        train_eps: Optional[float] = None,
        sample_eps: Optional[float] = None,
        loss_weighting: LossWeighting = "none",
        min_snr_gamma: float = 5.0,
        cosine_loss: bool = False,
        repa: Optional[REPAOptions] = None,
    ) -> None:
        super().__init__()
        # A plain list, not a tuple, so that hparams.yaml reads back with yaml.safe_load.
        latent_shape = list(latent_shape) if latent_shape is not None else [4, 32, 32]
        given = locals()  # the objective's settings are these arguments of the same names
        self.objective: TrainingObjective = build_objective(
            ObjectiveSettings(**{name: given[name] for name in ObjectiveSettings.names()})
        )
        # before save_hyperparameters, so that the record says what runs
        if learn_sigma != self.objective.learns_variance:
            rank_zero_info(f"{self.objective.describe()}: model.learn_sigma {self.objective.learns_variance}")
            learn_sigma = self.objective.learns_variance
        chosen = self.objective.sampler_for(sampler, tuple(DIFFUSERS_SAMPLERS))
        if chosen != sampler:
            rank_zero_info(f"{self.objective.describe()}: default sampler {chosen} (model.sampler)")
            sampler = chosen  # type: ignore[assignment]  # one of the objective's samplers
        self.save_hyperparameters(ignore=["optimizer", "lr_scheduler"])
        record: Any = repa  # REPAOptions, or a checkpoint's record (a dict)
        reg = record.get("class_token_weight") if isinstance(record, dict) else getattr(record, "class_token_weight", 0)
        if float(reg or 0) > 0:  # refused before the encoder is loaded and hashed
            if not isinstance(self.objective, FlowMatching):
                raise ValueError("REG trains with the flow objective: set model.objective flow")
            if self.objective.prediction != "velocity":
                raise ValueError("REG trains the velocity of its class token: set model.prediction velocity")
        # REPA's head reads its encoder's feature width (and hashes its weights) for the record
        self.repa: Optional[REPAHead] = repa_head(repa, image_shape_of(latent_shape, is_pixel_space(vae)))
        # Under LightningCLI save_hyperparameters records the parsed config, not these locals: the record
        # must say what runs (a flow model's sampler and variance), so set what the objective changed.
        records: tuple[Any, ...] = (self.hparams, self._hparams_initial)
        for record in records:  # the checkpoint's and the logger's (hparams.yaml)
            record.update(
                **self.objective.record(),
                learn_sigma=learn_sigma,
                sampler=sampler,
                repa=self.repa.record() if self.repa is not None else None,
            )
        if len(latent_shape) != 3 or latent_shape[1] != latent_shape[2]:
            raise ValueError(f"latent_shape must be (C, H, H) with square latents, got {latent_shape}")
        self.model: DiT = build_dit(
            model,
            input_size=latent_shape[1],
            in_channels=latent_shape[0],
            num_classes=num_classes if num_classes is not None else 1000,
            depth=depth,
            hidden_size=hidden_size,
            num_heads=num_heads,
            patch_size=patch_size,
            mlp_ratio=mlp_ratio,
            attn_dim=attn_dim,
            learn_sigma=learn_sigma,
            class_dropout_prob=class_dropout_prob,
            qk_norm=qk_norm,
            norm=norm,
            mlp=mlp,
            pos_embed=pos_embed,
            wo_shift=wo_shift,
            activation_checkpointing=activation_checkpointing,
            class_token_dim=self.repa.class_token_dim if self.repa is not None else None,
        )
        self.optimizer_factory = optimizer
        self.lr_scheduler_factory = lr_scheduler
        if warmup_steps > 0:
            rank_zero_deprecation(
                "DiTModule(warmup_steps=N) is deprecated: set lr_scheduler to "
                "dit_lightning.schedules.WarmupDecayLR with warmup_steps: N (the same schedule)"
            )
        self.ema: Optional[DiT] = None
        initial = read_checkpoint(init_from) if init_from else None
        if initial is not None:
            # the same reading of both state dicts, so that only a real difference shows
            theirs = infer_dit_config(initial.model, f"checkpoint '{init_from}'")
            ours = infer_dit_config(self.model.state_dict())
            if any(theirs[k] != ours[k] for k in ("in_channels", "input_size", "num_classes")):
                self._check_data_shape(
                    [theirs["in_channels"], theirs["input_size"], theirs["input_size"]],
                    theirs["num_classes"] + ours["num_classes"] - self.model.num_classes,
                    f"--model.init_from {init_from}",
                )
            self._check_transform(transform_of(initial.args), f"--model.init_from {init_from}")
            weights = self._init_weights(initial.model, self.model, init_from)
            load_dit_weights(self.model, weights, source=f"checkpoint '{init_from}'")
        if ema:
            self.ema = copy.deepcopy(self.model).requires_grad_(False).eval()
            if initial is not None and initial.ema is not None:
                weights = self._init_weights(initial.ema, self.ema, init_from)
                load_dit_weights(self.ema, weights, source=f"EMA weights of '{init_from}'")
        self._decoder_cache: dict[str, nn.Module] = {}  # a plain dict: keeps the VAE out of the state dict
        if self.repa is not None:  # registered here: checkpoints name its weights repa_projector.*
            self.repa_projector = self.repa.attach(self.model)

    def on_fit_start(self) -> None:
        self._check_store_features()

    def on_validation_start(self) -> None:
        if self.repa is not None and self.repa.class_token_dim:  # REG's evaluation reads the store's class token
            self._check_store_features()

    def on_test_start(self) -> None:
        if self.repa is not None and self.repa.class_token_dim:
            self._check_store_features()

    def _check_store_features(self) -> None:
        # features precomputed in the store must be this run's encoder's: said before the first step
        data = getattr(self._trainer, "datamodule", None) if self._trainer is not None else None
        spec, unfinished = getattr(data, "repa_spec", None), getattr(data, "repa_unfinished", None)
        if self.repa is not None and unfinished:
            raise ValueError(unfinished)  # not online features unawares: the store's features pass is half done
        if self.repa is not None and spec:
            self.repa.check_store(spec)

    def _init_weights(self, sd: dict[str, Tensor], target: DiT, init_from: Optional[str]) -> dict[str, Tensor]:
        """``init_from``'s weights for ``target`` (the network or its EMA): an objective that drops unused
        outputs (flow) also takes SiT's layout (2C outputs, the last C unused: the released
        SiT-XL-2-256x256.pt). A REG run fine-tunes a checkpoint without REG's class-token layers (a
        released SiT or DiT): those layers, and only those, keep ``target``'s own REG initialisation;
        a REG checkpoint into a run without REG is refused (its token layers would be dropped)."""
        sd = clean_state_dict(sd)
        if self.objective.drops_unused_outputs:
            sd = sit_output_layout(sd, self.model)
        theirs = [k for k in sd if k.startswith(_CLASS_TOKEN_LAYERS)]
        if theirs and not target.class_token_dim:
            width = sd["cls_embedder.proj.weight"].shape[1] if "cls_embedder.proj.weight" in sd else "?"
            raise ValueError(
                f"--model.init_from {init_from} holds REG's class-token layers (a token of width {width}): "
                "fine-tune it with REG, --model.repa.class_token_weight 0.03 (REG's) and a model.repa.encoder "
                f"whose class token has width {width}"
            )
        if theirs or not target.class_token_dim:
            return sd  # loads strictly, or not at all
        own = {k: v for k, v in target.state_dict().items() if k.startswith(_CLASS_TOKEN_LAYERS)}
        if target is self.model:  # said once, not again for the EMA
            layers = ", ".join(p + "*" for p in _CLASS_TOKEN_LAYERS)
            rank_zero_info(
                f"--model.init_from {init_from} has no class-token layers: {layers} start at REG's initialisation, "
                "every other weight is the checkpoint's"
            )
        return {**sd, **own}

    if TYPE_CHECKING:

        @property
        def hparams(self) -> AttributeDict:
            """The ``__init__`` arguments saved by ``save_hyperparameters`` (always an ``AttributeDict`` here)."""

    # ---- weights ----------------------------------------------------------------------
    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        trainer = self._trainer
        if trainer is not None and trainer.state.fn != "fit" and "loops" in checkpoint:
            # validate / test / predict of a checkpoint: restore its step (Lightning restores the
            # loops only to resume fit), so metrics are logged at the step they belong to
            trainer.fit_loop.load_state_dict(checkpoint["loops"]["fit_loop"])
        # Refuse a checkpoint of another architecture with a message that says which one it
        # is, before Lightning's generic load_state_dict error.
        hp = checkpoint.get("hyper_parameters") or {}
        self._check_data_shape(hp.get("latent_shape"), hp.get("num_classes"), "the checkpoint (--ckpt_path)")
        theirs = objective_from_record(hp) if hp else None
        if theirs is not None and self.objective.differences(theirs):
            wrong = ", ".join(f"model.{k} {b} (this run: {a})" for k, a, b in self.objective.differences(theirs))
            raise ValueError(
                f"the checkpoint (--ckpt_path) was trained with {theirs.describe()}: {wrong}. Configure the run as the "
                "checkpoint's (its run's config.yaml), or start a new run with --model.init_from for its weights"
            )
        self._check_transform(transform_of(hp) if hp else None, "the checkpoint (--ckpt_path)")
        recorded_repa = hp.get("repa")
        if self.repa is not None and isinstance(recorded_repa, dict) and recorded_repa.get("encoder"):
            changed = EncoderIdentity.from_record(recorded_repa).differences(self.repa.identity())
            if changed:  # each names this run's encoder, then "this one": the checkpoint's
                raise ValueError(
                    "the checkpoint (--ckpt_path) was trained against another REPA encoder: this run's "
                    + "; ".join(changed).replace("this one", "the checkpoint's")
                    + ". Give the encoder and weights the run was trained with (model.repa.encoder / weights)"
                )
        if "state_dict" not in checkpoint:  # sharded checkpoint: loaded (strictly) by the strategy
            return
        sd = checkpoint["state_dict"]
        check_dit_weights(self.model, strip_prefix(sd, "model."), source="the checkpoint being resumed")
        bad = {which: nonfinite_tensors(strip_prefix(sd, prefix)) for prefix, which in _WEIGHT_SETS}
        if any(bad.values()):  # --ckpt_path: refused like every other reader of weights
            path = getattr(trainer, "ckpt_path", None) if trainer is not None else None
            raise NonFiniteWeightsError(nonfinite_message(f"checkpoint '{path}'" if path else "the checkpoint", bad))

    def _check_data_shape(self, latent_shape: Optional[Sequence[int]], num_classes: Optional[int], source: str) -> None:
        """A checkpoint of other latents or classes than the store's: say that the store differs
        (the CLI links the model's latent shape and classes to ``data.path``), not the model."""
        net = self.model
        mine = ([net.in_channels, net.input_size, net.input_size], net.num_classes)
        theirs = (list(latent_shape) if latent_shape is not None else mine[0], num_classes or mine[1])
        if [int(v) for v in theirs[0]] == mine[0] and int(theirs[1]) == int(mine[1]):
            return
        raise ValueError(
            f"{source} was trained on latents {tuple(theirs[0])} with {theirs[1]} classes, but the model is set up for "
            f"latents {tuple(mine[0])} with {mine[1]} classes, which the CLI takes from the data store (data.path). "
            "Point --data.path at the store the checkpoint was trained on (or one with the same latent shape and "
            "classes)."
        )

    @property
    def latent_transform(self) -> Optional[LatentTransform]:
        """The latent transform of the latents this model makes (the store's): its record
        (``latent_transform``), else the trainer's data module's, else the legacy reading of ``vae`` /
        ``scale_factor`` (:func:`~dit_lightning.latents.transform_of`); None when unknown (no VAE or
        no factor named, no data module yet: a module built in Python before ``fit``)."""
        record = self.hparams.get("latent_transform")
        if record:
            return LatentTransform.from_record(record)
        # Trainer.datamodule: set by Lightning's data connector, not declared on the class.
        data = self._trainer.datamodule if self._trainer is not None else None  # type: ignore[attr-defined]
        record = getattr(data, "latent_transform", None)
        if record:
            return LatentTransform.from_record(record)
        scale = self.hparams.get("scale_factor") or getattr(data, "scale_factor", None)
        return transform_of({"vae": self.hparams.get("vae"), "scale_factor": scale})

    def _check_transform(self, theirs: Optional[LatentTransform], source: str) -> None:
        """Weights trained on latents of another transform would see differently scaled (or shifted)
        data here: refused with both transforms named. A file that records none, or a module that
        knows none yet, is not checked."""
        mine = self.latent_transform
        if theirs is None or mine is None:
            return
        if mine.difference(theirs):
            raise ValueError(
                f"{source} was trained on latents of another latent transform ({theirs.describe()}) than this "
                f"run's store ({mine.describe()}). "
                "Point --data.path at a store extracted with the checkpoint's transform (same VAE, --latent_norm, "
                "multiplier), or start from scratch on this store"
            )

    @property
    def eval_model(self) -> DiT:
        """The network used for validation and sampling (EMA unless ``eval_weights="raw"``)."""
        if self.hparams.eval_weights == "ema" and self.ema is not None:
            return self.ema
        return self.model

    @property
    def shape(self) -> DiTShape:
        return DiTShape.of(self.model)

    def flops_per_image(self) -> tuple[int, int]:
        """(useful, executed) training FLOPs per image, counting activation recomputation apart."""
        return training_flops(self.shape, recomputed_blocks=len(self.model.checkpoint_blocks))

    def forward_macs_per_image(self) -> int:
        return dit_macs(self.shape)

    # ---- set-up hooks ------------------------------------------------------------------
    def configure_model(self) -> None:
        if torch.cuda.is_available():
            set_tf32(bool(self.hparams.tf32))  # both ways: tf32=false switches it off again
        trainer = self._trainer
        if self.hparams.attention_backend == "flash" and trainer is not None:
            dtype = compute_dtype(trainer)
            if trainer.strategy.root_device.type == "cuda" and dtype not in (torch.float16, torch.bfloat16):
                raise ValueError(
                    f"model.attention_backend flash needs 16-bit compute on CUDA, and this run computes in {dtype}: "
                    "use trainer.precision bf16-mixed or 16-mixed, or attention_backend efficient / auto"
                )
        configure_sharding(self)  # FSDP2 under a ModelParallelStrategy (before compiling); else a no-op
        mode = self.hparams.compile
        if mode == "model" and not getattr(self.model, "_compiled", False):
            self.model.compile()  # in place: parameter names (and checkpoints) stay the same
            self.model._compiled = True
        elif mode == "blocks" and not getattr(self.model, "_compiled", False):
            for block in self.model.blocks:
                block.compile()
            self.model._compiled = True

    def _use_fused(self) -> bool:
        return use_fused_adamw(self.hparams.fused_optimizer, self.device, self._trainer)

    def trained_parameters(self) -> list[Any]:
        """What the optimiser steps: the DiT's trainable weights (group 0, the reference checkpoint's
        optimiser state) and REPA's projector in a group of its own (dropped by exports)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.repa is None:
            return params
        return [{"params": params}, {"params": list(self.repa_projector.parameters())}]

    def configure_optimizers(self) -> Any:
        return configure_training_optimizers(
            self.trained_parameters(),
            self.optimizer_factory,
            self.lr_scheduler_factory,
            fused=self._use_fused,
            warmup_steps=self.hparams.warmup_steps,
            trainer=self._trainer,
        )

    # ---- the training objective -----------------------------------------------------------
    def _attention_context(self) -> contextlib.AbstractContextManager[Any]:
        return attention_kernel(self.hparams.attention_backend)

    def diffusion_loss(self, net: ModelFn, batch: dict[str, Tensor], step_key: int, train: bool) -> dict[str, Tensor]:
        """Per-batch mean of the objective's terms (:attr:`objective`) with times, noise and label
        dropout keyed on (seed, step, sample index): independent of process layout, resumable bit-for-bit."""
        x, y, index = batch["x"], batch["y"], batch["index"]
        keys = sample_keys(index.to(x.device), self.hparams.seed, step_key)
        noise = keyed_normal(keys, x.shape[1:], stream=_STREAM_NOISE).to(x.dtype)
        kwargs: dict[str, Tensor] = {"y": y}
        if train and self.hparams.class_dropout_prob > 0:
            kwargs["force_drop_ids"] = keyed_uniform(keys, (), stream=_STREAM_DROP) < self.hparams.class_dropout_prob
        u = keyed_uniform(keys, (), stream=_STREAM_T)  # the objective maps it to its time
        with self._attention_context():
            terms = self.objective.training_terms(net, x, noise, u, kwargs)
        return {k: v.mean() for k, v in terms.items()}

    # ---- the training step: one home for plain runs, auto-fit's back-off and distillation ----------
    # The setting in force, put there by auto-fit (dit_lightning.callbacks.autofit.AutoFit) when it may
    # redo steps: each batch (this rank's share of an optimiser step) is split into micro-batches of
    # ``micro_batch_size`` samples, and ``out_of_memory_handler(failure, step)`` is told of an
    # out-of-memory error before the step is redone (it changes the setting, or raises to give up).
    micro_batch_size: Optional[int] = None
    out_of_memory_handler: Optional[Callable[[str, int], None]] = None
    _step_accumulated = False  # this step's gradients were accumulated inside training_step

    def training_losses(self, batch: dict[str, Tensor], step: int) -> dict[str, Tensor]:
        """The objective of one (micro-)batch at optimiser step ``step``: ``loss`` and the terms to log
        (subclasses change the objective here, e.g. distillation; the step around it stays)."""
        if self.repa is None:
            return self.diffusion_loss(self.model, batch, step, train=True)
        return self.head_losses(self.model, batch, step, train=True)

    def head_losses(self, net: DiT, batch: dict[str, Tensor], step_key: int, train: bool) -> dict[str, Tensor]:
        """REPA's (and REG's) terms around the objective's (:meth:`REPAHead.losses`): the encoder's
        targets, and REG's class-token noise keyed on (seed, step, sample index) like the latents'."""
        head = self.repa
        assert head is not None
        patches, token = head.targets(batch, self.decode)
        noise, interpolate = None, None
        if token is not None:
            assert isinstance(self.objective, FlowMatching)  # REG's objective, checked when built
            keys = sample_keys(batch["index"].to(token.device), self.hparams.seed, step_key)
            noise = keyed_normal(keys, token.shape[1:], stream=_STREAM_CLASS_TOKEN)
            interpolate = self.objective.interpolate
        return head.losses(
            net,
            lambda fn: self.diffusion_loss(fn, batch, step_key, train),
            (patches, token),
            noise,
            interpolate,
            step=step_key if train else None,
        )

    def training_step(self, batch: dict[str, Tensor], batch_idx: int) -> Union[Tensor, dict[str, Tensor]]:
        """One (micro-)batch of the optimiser step: Lightning accumulates, reduces the gradients (DDP's
        buckets, FSDP's reduce-scatter), clips, scales (16-mixed), steps the optimiser and the schedule,
        and :meth:`optimizer_step` updates the EMA. Under auto-fit's recovery the batch is the whole
        step and is split by the setting in force; an out-of-memory error redoes it (:meth:`_redoable_step`)."""
        n = int(batch["x"].shape[0])
        if self.out_of_memory_handler is not None:
            terms = self._redoable_step(batch, self.out_of_memory_handler)
            self._log_training_terms(terms, n)
            # the gradients are complete: this loss only lets Lightning's backward pass reduce them
            return {"loss": self._gradient_reduction_loss(), "step_loss": terms["loss"]}
        terms = self.training_losses(batch, self.global_step)
        self._log_training_terms(terms, n)
        return terms["loss"]

    def _log_training_terms(self, terms: dict[str, Tensor], batch_size: int) -> None:
        self.log("train/loss", terms["loss"], prog_bar=True, sync_dist=True, batch_size=batch_size)
        for name, value in terms.items():
            if name != "loss" and not (name == "mse" and "vb" not in terms):  # without vb, mse is the loss
                self.log(f"train/{name}", value, sync_dist=True, batch_size=batch_size)

    def _redoable_step(self, batch: dict[str, Tensor], handler: Callable[[str, int], None]) -> dict[str, Tensor]:
        """Forward and backward passes of every micro-batch of the step, redone with the setting the
        handler puts in force after an out-of-memory error: the same samples, keyed timesteps, noise and
        label dropout (keyed on the step and the sample index, not on the split), so the trajectory is
        that of a run started with the safer setting. The gradients stay local (``no_sync``) until
        every rank has finished: with several ranks one collective says whether any ran out of memory,
        so all redo the step together and none waits in a reduction another never joins."""
        trainer = self.trainer
        strategy = trainer.strategy
        optimizer = self.optimizers()
        assert not isinstance(optimizer, list)
        step, n = self.global_step, int(batch["x"].shape[0])
        while True:
            micro = self.micro_batch_size or n
            if n % micro:
                raise ValueError(f"this rank's batch of {n} does not split into micro-batches of {micro}")
            parts = n // micro
            optimizer.zero_grad(set_to_none=True)  # Lightning zeroes only before its own backward pass
            failure: Optional[str] = None
            sums: dict[str, Tensor] = {}
            for j in range(parts):
                part = {k: v[j * micro : (j + 1) * micro] for k, v in batch.items()}
                try:
                    with no_sync(strategy):
                        terms = self.training_losses(part, step)
                        strategy.backward(terms["loss"] / parts, optimizer.optimizer)  # the precision plugin scales it
                    for k, v in terms.items():
                        sums[k] = sums[k] + v.detach() if k in sums else v.detach()
                    del terms
                except Exception as error:  # out of memory on any device kind; anything else is raised
                    if not is_out_of_memory(error):
                        raise
                    failure = f"{str(error).splitlines()[0][:160]} (micro-batch {j + 1} of {parts})"
                    forget_failed_pass(error)  # its frames hold the failed pass's activations
                    break
                finally:
                    part = {}
            failed = first_failed_rank(trainer, failure is not None)
            if failed < 0:
                self._step_accumulated = True
                return {k: v / parts for k, v in sums.items()}
            sums.clear()
            optimizer.zero_grad(set_to_none=True)
            free_device_memory(self.device)  # the safer split allocates anew
            handler(failure or f"rank {failed} ran out of memory", step)

    def _gradient_reduction_loss(self) -> Tensor:
        """A loss of value 0 whose backward pass adds zeros to every trainable parameter's gradient:
        through it, Lightning's backward lets the strategy reduce the gradients accumulated by
        :meth:`_redoable_step` (DDP all-reduces its buckets) with the usual hooks and precision."""
        params = [p for p in self.parameters() if p.requires_grad]
        if self.trainer.world_size == 1:
            params = params[:1]  # nothing to reduce: one parameter keeps the backward pass trivial
        return torch.stack([p.reshape(-1)[0] for p in params]).sum() * 0.0

    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        # Lightning zeroes the gradients between training_step and its backward pass: a redoable step
        # has accumulated them inside training_step already, and they must stay.
        if self._step_accumulated:
            self._step_accumulated = False
            return
        super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    def _eval_step(self, batch: dict[str, Tensor], stage: str) -> Tensor:
        if self.repa is not None and self.repa.class_token_dim:  # REG's network takes the noisy class token
            terms = self.head_losses(self.eval_model, batch, _VAL_STEP_KEY, train=False)
        else:
            terms = self.diffusion_loss(self.eval_model, batch, _VAL_STEP_KEY, train=False)
        bs = batch["x"].shape[0]
        for name, value in terms.items():
            self.log(f"{stage}/{name}", value, sync_dist=True, batch_size=bs, prog_bar=name == "loss")
        return terms["loss"]

    def validation_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._eval_step(batch, "val")

    def test_step(self, batch: dict[str, Tensor], batch_idx: int) -> Tensor:
        return self._eval_step(batch, "test")

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        # Lightning's connectors set Trainer.log_every_n_steps at run time; the class does not declare it.
        every = self.trainer.log_every_n_steps if self._trainer is not None else 1  # type: ignore[attr-defined]
        # Lightning writes step metrics after step s when (s + 1) % every == 0 (s counted from 0):
        # compute the norm (a collective under FSDP) exactly then, so it lands at every log point.
        if every > 0 and (self.global_step + 1) % every == 0:
            norm = grad_norm(self.model.parameters(), self._trainer.strategy if self._trainer is not None else None)
            scaler = grad_scaler(self._trainer)
            if scaler is not None:  # 16-mixed: the GradScaler's current loss scale
                self.log("train/loss_scale", float(scaler.get_scale()), batch_size=1)
            pending = pending_grad_scale(self._trainer, optimizer)
            if norm is not None and pending:  # fused AdamW unscales inside its step: not yet done here
                norm = norm / pending
            if norm is not None:
                self.log("train/grad_norm", norm, batch_size=1)

    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: Optional[float] = None,
        gradient_clip_algorithm: Optional[str] = None,
    ) -> None:
        clip_gradients(  # clipping by norm that also works under FSDP1/FSDP2
            self, optimizer, gradient_clip_val, gradient_clip_algorithm
        )

    # ---- EMA ----------------------------------------------------------------------------
    def ema_decay_at(self, step: int) -> float:
        decay = self.hparams.ema_decay
        if self.hparams.ema_warmup:
            decay = min(decay, (1 + step) / (10 + step))
        return decay

    @torch.no_grad()
    def update_ema(self) -> None:
        """ema <- decay * ema + (1 - decay) * model, over every parameter (one fused kernel)."""
        if self.ema is None:
            return
        ema_update_(  # lerps local shards under FSDP: never gathers
            self.ema, self.model, 1.0 - self.ema_decay_at(self.global_step)
        )

    def optimizer_step(self, epoch: int, batch_idx: int, optimizer: Any, optimizer_closure: Any = None) -> None:
        # Called once per optimiser step (after all accumulated micro-batches), so the EMA
        # follows optimiser steps, not batches.
        super().optimizer_step(epoch, batch_idx, optimizer, optimizer_closure)
        self.update_ema()

    # ---- sampling -------------------------------------------------------------------------
    @torch.no_grad()
    def sample(
        self,
        labels: Union[Tensor, Sequence[int]],
        options: Optional[SamplingOptions] = None,
        *,
        indices: Optional[Union[Tensor, Sequence[int]]] = None,
        noise: Optional[Tensor] = None,
        use_ema: Optional[bool] = None,
        on_step: Optional[Callable[[int], None]] = None,
        **overrides: Any,
    ) -> Tensor:
        """Class-conditional samples (latents, before the VAE's scale is undone) for ``labels``.

        How: ``options`` and keyword ``overrides`` of its fields (``num_steps=50, sampler="ddim",
        cfg_scale=4.0, seed=1``; :class:`~dit_lightning.sampling.SamplingOptions`); unset ones take
        this module's ``sampler`` / ``sample_steps`` / ``cfg_scale`` / ``guide_channels``, and pixel
        stores clamp each x_0 estimate to [-1, 1] (their data range; latents never).
        Sample ``indices[k]`` (default ``k``) draws its initial and per-step noise from keys
        (seed, index, step): the same call gives the same images, whatever the batching.
        """
        hp = self.hparams
        use_ema = (hp.eval_weights == "ema") if use_ema is None else use_ema
        net = self.ema if (use_ema and self.ema is not None) else self.model
        opts = sampling_options(options, **overrides).over(SamplingOptions.from_hparams(hp, net.in_channels))
        with self._attention_context():
            return sample_latents(
                net, labels, indices, options=opts, objective=self.objective, noise=noise, on_step=on_step
            )

    def predict_step(self, batch: dict[str, Tensor], batch_idx: int) -> dict[str, Tensor]:
        """Images in [0, 1] for ``batch = {"index", "y"}`` (see ``LatentDataModule.predict_dataloader``);
        sample i is keyed on (seed, i), so the output does not depend on batching or devices."""
        progress = StepLines(f"predict batch {batch_idx}")  # a batch may denoise for minutes
        latents = self.sample(batch["y"], seed=self.hparams.seed, indices=batch["index"], on_step=progress)
        return {"index": batch["index"], "y": batch["y"], "images": self.decode(latents)}

    def decode(self, latents: Tensor, transform: Optional[Union[LatentTransform, float]] = None) -> Tensor:
        """Images in [0, 1], (N, 3 or 1, H, W): the latents through the inverse of the store's latent
        transform (:attr:`latent_transform`; a number: a ``scale`` transform of that factor) and the
        VAE, or directly for pixel stores."""
        name = self.hparams.vae
        if is_pixel_space(name):
            return decode_latents(latents, None)
        if name not in self._decoder_cache:
            self._decoder_cache[name] = load_vae(name)
        vae = self._decoder_cache[name].to(latents.device)
        if transform is None:  # unknown (a VAE named without its factor): DiT's SD-VAE factor
            transform = self.latent_transform or DEFAULT_SCALE_FACTOR
        return decode_latents(latents, vae, transform)
