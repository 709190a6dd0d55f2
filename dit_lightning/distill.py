"""Knowledge distillation: train a small DiT (the student) to match a frozen large one (the teacher).

:class:`DistillationModule` is a :class:`~dit_lightning.module.DiTModule`, so the CLI, EMA,
checkpointing, precision and every other lever apply to the student unchanged. Its loss is

    alpha_diffusion * hybrid diffusion loss
    + alpha_output   * MSE(student eps, teacher eps)
    + alpha_variance * MSE(student variance output, teacher variance output)
    + alpha_feature  * mean over feature_pairs of MSE(proj(student block out), teacher block out)

with the teacher evaluated on the very ``x_t, t, y`` (and label dropout) the student sees.

The teacher is kept *outside* the module tree (in a plain dict, like the VAE cache of
DiTModule): it is not in ``state_dict()`` (so not in checkpoints), not in ``parameters()``
(so not in the optimiser, DDP's gradient buckets or the EMA), and ``train()`` never switches
it out of eval mode. It is re-read from ``teacher`` (a path, kept in the hyper-parameters) on
construction, which is also what happens on resume; it follows the student's device and
dtype lazily at each use, so true-precision runs (``bf16-true``) cast it and mixed-precision
runs evaluate it under the same autocast as the student.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.hooks import RemovableHandle

from .checkpoints import load_dit
from .diffusion import objective_from_record
from .latents import transform_of
from .models import DiT
from .module import _VAL_STEP_KEY, DiTModule

log = logging.getLogger(__name__)


class DistillationModule(DiTModule):
    """Train the configured DiT (the student) from a frozen teacher checkpoint.

    Args:
        teacher: any supported checkpoint (Lightning, reference format, raw state dict, a
            pruned file); its architecture is recovered from the weights (and its recorded
            arguments, for the number of heads). ``None``: no teacher (plain DiT training), e.g.
            ``DistillationModule.load_from_checkpoint(path, teacher=None)`` to sample without it.
        teacher_weights: "ema" (default; raw weights if the file has no EMA) or "model".
        alpha_diffusion: weight of the usual hybrid diffusion loss on the data.
        alpha_output: weight of the MSE between student and teacher epsilon outputs.
        alpha_variance: weight of the MSE between the variance outputs (default alpha_output).
        alpha_feature: weight of the feature loss (needs ``feature_pairs``).
        feature_pairs: ``[[student_block, teacher_block], ...]``: block outputs to match; a
            learned Linear maps the student width to the teacher's where they differ.
        feature_normalize: LayerNorm (no affine) both features before the MSE, so the loss
            does not depend on the residual stream's growing scale along the depth.
        **kwargs: the arguments of :class:`DiTModule` (the student's architecture and recipe).
    """

    def __init__(
        self,
        teacher: Optional[str] = None,
        teacher_weights: Literal["ema", "model"] = "ema",
        alpha_diffusion: float = 1.0,
        alpha_output: float = 1.0,
        alpha_variance: Optional[float] = None,
        alpha_feature: float = 0.0,
        feature_pairs: Optional[list[tuple[int, int]]] = None,
        feature_normalize: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)  # saves every argument, ours included, as hyper-parameters
        if self.repa is not None and teacher is not None:
            raise ValueError(
                "model.repa with distillation: the student learns from the teacher here, and REPA's alignment is "
                "not part of the distillation objective; unset model.repa.encoder, or train with DiTModule"
            )
        self.alpha_diffusion = float(alpha_diffusion)
        self.alpha_output = float(alpha_output)
        self.alpha_variance = float(alpha_output if alpha_variance is None else alpha_variance)
        self.alpha_feature = float(alpha_feature)
        self.feature_pairs: list[tuple[int, int]] = [(int(s), int(t)) for s, t in (feature_pairs or [])]
        self.feature_normalize = feature_normalize
        # A plain dict is not an nn.Module attribute: the teacher stays out of the module tree.
        self._frozen: dict[str, DiT] = {}
        self.feature_proj = nn.ModuleList()
        if teacher is None:  # no distillation terms (e.g. loaded to sample): projections unused
            return
        loaded = load_dit(teacher, weights=teacher_weights)
        net = loaded.net
        if net.class_token_dim is not None:  # its outputs depend on a noisy class token the student has not
            raise ValueError(
                f"teacher {teacher} has REG's class token (class_token_dim {net.class_token_dim}): distillation takes "
                "teachers whose output depends on the latents, time and label only; distil from a network without it"
            )
        self._check_teacher(net, loaded.args, teacher)
        net.requires_grad_(False).eval()
        self._frozen["teacher"] = net
        for s, t in self.feature_pairs:
            if not (0 <= s < len(self.model.blocks) and 0 <= t < len(net.blocks)):
                raise ValueError(
                    f"feature pair ({s}, {t}) out of range: the student has blocks 0..{len(self.model.blocks) - 1}, "
                    f"the teacher 0..{len(net.blocks) - 1}"
                )
            ds, dt = self.model.hidden_size, net.hidden_size
            self.feature_proj.append(nn.Linear(ds, dt) if ds != dt else nn.Identity())

    # ---- the teacher ----------------------------------------------------------------------
    def _check_teacher(self, net: DiT, args: dict[str, Any], path: str) -> None:
        """The student must model the same data and process as the teacher: say what differs."""
        s = self.model
        problems = [
            f"{name}: student {a}, teacher {b}"
            for name, a, b in (
                (
                    "latent_shape",
                    (s.in_channels, s.input_size, s.input_size),
                    (net.in_channels, net.input_size, net.input_size),
                ),
                ("num_classes", s.num_classes, net.num_classes),
                ("learn_sigma", s.learn_sigma, net.learn_sigma),
            )
            if a != b
        ]
        teacher = objective_from_record(args)  # None: the file does not say
        if teacher is not None:
            problems += [f"{k}: student {a}, teacher {b}" for k, a, b in self.objective.differences(teacher)]
        transform, mine = transform_of(args), self.latent_transform  # None: the file (or the student) does not say
        if transform is not None and mine is not None and mine.difference(transform):
            problems.append(f"latent transform: student {mine.describe()}, teacher {transform.describe()}")
        if self.hparams.class_dropout_prob > 0 and net.y_embedder.embedding_table.num_embeddings <= net.num_classes:
            problems.append("label dropout: the student drops labels but the teacher has no null-class embedding")
        if self.feature_pairs and s.patch_size != net.patch_size:
            problems.append(
                f"feature distillation needs equal token counts: patch size student {s.patch_size}, teacher "
                f"{net.patch_size}"
            )
        if problems:
            raise ValueError(
                f"teacher '{path}' does not match the student: "
                + "; ".join(problems)
                + ". Configure the student (and data) like the teacher's."
            )

    @property
    def teacher(self) -> Optional[DiT]:
        """The frozen teacher (eval mode, no gradients), or None."""
        return self._frozen.get("teacher")

    def teacher_net(self) -> DiT:
        """The teacher on the student's device and in its parameter dtype (so ``bf16-true``
        casts it; under mixed precision both are fp32 and autocast applies to both)."""
        net = self._frozen["teacher"]
        ref = next(self.model.parameters())
        cur = next(net.parameters())
        if cur.device != ref.device or cur.dtype != ref.dtype:
            net.to(device=ref.device, dtype=ref.dtype)
        return net

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)
        # Loaded without a teacher (to sample or evaluate the student): the feature
        # projections were not built, so their saved weights have nowhere to go.
        if self.teacher is None:
            sd = checkpoint.get("state_dict", {})
            for key in [k for k in sd if k.startswith("feature_proj.")]:
                del sd[key]

    # ---- the objective --------------------------------------------------------------------
    def configure_optimizers(self) -> Any:
        config = super().configure_optimizers()
        params = [p for p in self.feature_proj.parameters() if p.requires_grad]
        if not params:
            return config
        # The projections learn with the student, under its optimiser settings.
        optimizer = config["optimizer"] if isinstance(config, dict) else config
        optimizer.add_param_group({"params": params})
        sched = config.get("lr_scheduler", {}).get("scheduler") if isinstance(config, dict) else None
        if isinstance(sched, torch.optim.lr_scheduler.LambdaLR):
            # A LambdaLR knows only the groups it was built with: rebuild it with the same
            # warm-up so the new group follows it too (group 0 keeps its initial_lr).
            config["lr_scheduler"]["scheduler"] = torch.optim.lr_scheduler.LambdaLR(optimizer, sched.lr_lambdas[0])
        return config

    @staticmethod
    def _capture(blocks: nn.ModuleList, indices: Sequence[int], store: dict[int, Tensor]) -> list[RemovableHandle]:
        def make(i: int) -> Callable:
            def hook(_m: nn.Module, _args: Any, out: Tensor) -> None:
                # Hooks live only for one loss computation, so the backward pass's activation
                # recomputation (which re-runs blocks) never reaches them.
                store.setdefault(i, out)

            return hook

        return [blocks[i].register_forward_hook(make(i)) for i in sorted(set(indices))]

    def distillation_loss(self, net: DiT, batch: dict[str, Tensor], step_key: int, train: bool) -> dict[str, Tensor]:
        """The weighted total ``loss`` and its terms: ``diffusion`` (hybrid loss), ``mse``,
        ``vb``, ``distill_eps``, ``distill_var`` and ``distill_feat``."""
        weighted = self.alpha_output or self.alpha_variance or (self.alpha_feature and self.feature_pairs)
        if self.teacher is None or (train and not weighted):  # plain training: skip the teacher's forward
            terms = self.diffusion_loss(net, batch, step_key, train)
            return {**terms, "diffusion": terms["loss"]}
        teacher = self.teacher_net()
        outputs: dict[str, Tensor] = {}
        s_feats: dict[int, Tensor] = {}
        t_feats: dict[int, Tensor] = {}

        def student_and_teacher(x_t: Tensor, t: Tensor, **kwargs: Any) -> Tensor:
            # Called by the diffusion with the noised input, the (mapped) timesteps, the labels
            # and the label-dropout mask: the teacher sees exactly what the student sees.
            out = net(x_t, t, **kwargs)
            with torch.no_grad():
                outputs["teacher"] = teacher(x_t, t, **kwargs)
            outputs["student"] = out
            return out

        hooks: list[RemovableHandle] = []
        if self.feature_pairs and self.alpha_feature:
            hooks = self._capture(net.blocks, [s for s, _ in self.feature_pairs], s_feats)
            hooks += self._capture(teacher.blocks, [t for _, t in self.feature_pairs], t_feats)
        try:
            terms = self.diffusion_loss(student_and_teacher, batch, step_key, train)
        finally:
            for h in hooks:
                h.remove()
        s_out, t_out = outputs["student"].float(), outputs["teacher"].float()
        c = self.model.in_channels
        zero = s_out.new_zeros(())
        eps = F.mse_loss(s_out[:, :c], t_out[:, :c])
        var = F.mse_loss(s_out[:, c:], t_out[:, c:]) if self.model.learn_sigma else zero
        feat = zero
        if hooks:
            losses = []
            for (s, t), proj in zip(self.feature_pairs, self.feature_proj):
                fs, ft = proj(s_feats[s]).float(), t_feats[t].float()
                if self.feature_normalize:
                    fs, ft = F.layer_norm(fs, fs.shape[-1:]), F.layer_norm(ft, ft.shape[-1:])
                losses.append(F.mse_loss(fs, ft))
            feat = torch.stack(losses).mean()
        total = (
            self.alpha_diffusion * terms["loss"]
            + self.alpha_output * eps
            + self.alpha_variance * var
            + self.alpha_feature * feat
        )
        return {
            **terms,
            "diffusion": terms["loss"],
            "loss": total,
            "distill_eps": eps,
            "distill_var": var,
            "distill_feat": feat,
        }

    def training_losses(self, batch: dict[str, Tensor], step: int) -> dict[str, Tensor]:
        # DiTModule's step (auto-fit's split and redo included) around the distillation objective;
        # every term is logged as train/<name>
        return self.distillation_loss(self.model, batch, step, train=True)

    def _eval_step(self, batch: dict[str, Tensor], stage: str) -> Tensor:
        # `loss` stays the plain diffusion loss, comparable with DiTModule runs and the
        # teacher's own; the distance to the teacher is logged next to it.
        with torch.no_grad():
            terms = self.distillation_loss(self.eval_model, batch, _VAL_STEP_KEY, train=False)
        bs = batch["x"].shape[0]
        for name, value in terms.items():
            if name in ("loss", "distill_feat"):
                continue
            key = "loss" if name == "diffusion" else name
            self.log(f"{stage}/{key}", value, sync_dist=True, batch_size=bs, prog_bar=key == "loss")
        return terms["diffusion"]
