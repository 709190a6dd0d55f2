"""Writing a DiT for diffusers users (a ``DiTPipeline`` directory) and as a weights-only
``.safetensors`` file, both loadable without pickle and read back by :func:`read_checkpoint`.

A pipeline directory holds what ``DiTPipeline.from_pretrained(DIR)`` reads offline:

- ``transformer/``: ``config.json`` and ``diffusion_pytorch_model.safetensors`` (EMA weights by
  default), names mapped by the rule of :mod:`.diffusers_format`;
- ``scheduler/``: a diffusers scheduler with the model's training betas (DPM-Solver++ 2M by
  default; for a pixel-space model it clamps x0 to [-1, 1] as dit-lightning samples it);
- ``vae/``: the store's VAE when it can be written offline (a local ``save_pretrained``
  directory, or a hub id already in the Hugging Face cache), made to invert the store's latent
  transform in DiTPipeline's ``vae.decode(latents / scaling_factor)``: a plain scale as
  ``scaling_factor``; a shift or per-channel statistics (``channel_stats``) folded into
  ``post_quant_conv`` (one added where the VAE has none) with ``scaling_factor`` 1. Otherwise no
  ``vae/`` (``model_index.json`` has ``"vae": [null, null]``) and README.md says what to pass as
  ``vae=`` (the hub id, or :class:`PixelDecoder` for a pixel-space model);
- ``model_index.json`` (with ``id2label`` when the store knows class names), ``README.md`` (how
  to load it, what diffusers computes differently) and ``dit_lightning.json`` (the VAE
  reference, scale factor, ``latent_transform`` and ``latent_transform_in_vae``: how ``vae/``
  holds it, ``scaling_factor`` | ``post_quant_conv`` | ``unchanged``; noise schedule and source,
  for reading it back).

The directory is built next to ``output`` and renamed into place
(:func:`~dit_lightning.atomic.replace_directory`), so a reader never sees half of it, and a kill
during a re-export leaves the earlier export whole.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Union

import torch

from ..atomic import atomic_write, replace_directory, write_json, write_text
from ..diffusion import DDPMObjective, objective_from_record
from ..latents import LatentTransform, legacy_transform, transform_of
from ..sampling.schedulers import DiffusersSampler, build_scheduler, can_threshold
from ..vae import DEFAULT_SCALE_FACTOR, DEFAULT_VAE, is_pixel_space
from .architecture import dit_config_of, export_args, infer_dit_config, recorded_vae
from .diffusers_format import (
    _ARCH_REASON_HINT,
    INFO_FILE,
    METADATA_KEY,
    WEIGHT_FILE,
    NotExpressibleError,
    diffusers_transformer_config,
    reference_pos_embed,
    to_diffusers_state_dict,
)
from .formats import DiTCheckpoint, StateDict, Weights


def _check_pos_embed(sd: StateDict, cfg: dict[str, Any], source: str) -> None:
    """diffusers stores no position table (it recomputes the sin-cos one): refuse weights whose table is another."""
    table = reference_pos_embed(cfg["hidden_size"], cfg["input_size"] // cfg["patch_size"])
    mine = sd["pos_embed"]
    if tuple(mine.shape) != tuple(table.shape) or not torch.equal(mine, table.to(mine.dtype)):
        diff = (mine.float() - table).abs().max().item() if mine.shape == table.shape else float("nan")
        raise ValueError(
            f"the pos_embed of {source} is not the fixed sin-cos table (max difference {diff:.3g}); diffusers "
            "stores no position table and would recompute it: export it with --format safetensors instead"
        )


def _safetensors_bytes(tensors: StateDict, metadata: dict[str, str]) -> bytes:
    from safetensors.torch import save

    return save({k: v.detach().cpu().contiguous() for k, v in tensors.items()}, metadata=metadata)


# ---------------------------------------------------------------------------------------
# safetensors
# ---------------------------------------------------------------------------------------


def export_safetensors(ckpt: DiTCheckpoint, output: Union[str, Path], weights: Weights = "ema") -> dict[str, Any]:
    """Write one set of weights (EMA by default; ``"raw"``: the trained ones) under the reference
    names as a ``.safetensors`` file, the settings (architecture in ``model_config``, noise
    schedule, VAE...) as JSON in its metadata. Written atomically."""
    sd = ckpt.weights(weights)
    cfg, notes = dit_config_of(ckpt, sd)
    used = "ema" if weights == "ema" and ckpt.has_ema() else "raw"
    record = {
        "format_version": 1,
        "weights": used,
        "source": ckpt.path,
        "args": export_args(ckpt, cfg),
        **{k: ckpt.meta[k] for k in ("epoch", "global_step") if isinstance(ckpt.meta.get(k), int)},
    }
    data = _safetensors_bytes(sd, {METADATA_KEY: json.dumps(record), "format": "pt"})
    atomic_write(output, lambda f: f.write(data))
    if weights == "ema" and not ckpt.has_ema():
        notes.append(f"'{ckpt.path}' has no EMA weights; exported the trained weights")
    return {"output": str(output), "weights": used, "notes": notes}


# ---------------------------------------------------------------------------------------
# diffusers
# ---------------------------------------------------------------------------------------


def _store_spec(ckpt: DiTCheckpoint, store: Optional[str]) -> Optional[Any]:
    """The StoreSpec of ``store``, else of the store a Lightning checkpoint trained on (if it is here):
    a finished store's (its ``meta.json``, where a ``channel_stats`` transform has its statistics),
    else its plan's."""
    from ..data.digits import digits_spec
    from ..data.store import LatentStore, StoreError, is_store, load_plan

    def read(path: str) -> Any:
        return LatentStore(path).spec if is_store(path) else load_plan(path)

    if store is not None:
        return read(store)
    data = ckpt.meta.get("datamodule") or {}
    path = data.get("path")
    if isinstance(path, str) and os.path.isdir(path):
        try:
            return read(path)
        except StoreError:
            pass
    if data.get("prepare") == "digits":
        return digits_spec(int(data.get("digits_size") or 8))
    return None


def _write_vae(name: str, transform: Optional[LatentTransform], target: Path) -> tuple[Optional[str], str]:
    """Save the VAE ``name`` (local directory, or a hub id in the Hugging Face cache) to ``target`` so
    that DiTPipeline's ``vae.decode(latents / vae.config.scaling_factor)`` inverts ``transform``:
    a plain scale as ``scaling_factor``; a shift or per-channel statistics folded into
    ``post_quant_conv`` (the 1x1 convolution decode applies first; one is added where the VAE has
    none) with ``scaling_factor`` 1. Returns (why it could not be written or None, how the transform
    was recorded: ``scaling_factor`` | ``post_quant_conv`` | ``unchanged``)."""
    from diffusers.models import AutoencoderKL

    local = os.path.isdir(name)
    try:
        vae = AutoencoderKL.from_pretrained(name, local_files_only=True, low_cpu_mem_usage=False)
    except Exception as e:
        where = (
            "the local directory" if local else "the Hugging Face cache (this export reads nothing from the network)"
        )
        return f"{name!r} could not be loaded from {where}: {type(e).__name__}", "unchanged"
    how = "unchanged"
    if transform is not None and transform.kind == "scale" and not transform.shift:
        vae.register_to_config(scaling_factor=float(transform.scale))
        how = "scaling_factor"
    elif transform is not None and transform.kind != "pixels":
        fold_into_post_quant_conv(vae, transform)
        how = "post_quant_conv"
    vae.save_pretrained(str(target), safe_serialization=True)
    return None, how


def fold_into_post_quant_conv(vae: Any, transform: LatentTransform) -> None:
    """Make ``vae.decode(z)`` decode the model's latents ``z``: the inverse ``raw = a * z + c`` of
    ``transform`` folded into the 1x1 ``post_quant_conv`` (``W' = W diag(a)``, ``b' = W c + b``),
    ``scaling_factor`` 1 and no ``shift_factor``. A VAE without a ``post_quant_conv`` gets one (the
    affine map itself)."""
    channels = int(vae.config.latent_channels)
    a_list, c_list = transform.inverse_coefficients(channels)
    a = torch.tensor(a_list, dtype=torch.float64)
    c = torch.tensor(c_list, dtype=torch.float64)
    conv = vae.post_quant_conv
    if conv is None:
        conv = torch.nn.Conv2d(channels, channels, 1)
        weight = torch.eye(channels, dtype=torch.float64)
        bias = torch.zeros(channels, dtype=torch.float64)
        vae.register_to_config(use_post_quant_conv=True)
    else:
        weight = conv.weight.detach().to(torch.float64).reshape(channels, channels)
        bias = conv.bias.detach().to(torch.float64)
    dtype = next(vae.parameters()).dtype
    with torch.no_grad():
        conv.weight.copy_((weight * a[None, :]).reshape(channels, channels, 1, 1).to(dtype))
        conv.bias.copy_((weight @ c + bias).to(dtype))
    vae.post_quant_conv = conv.to(dtype)
    vae.register_to_config(scaling_factor=1.0, shift_factor=None)


def _check_replaceable(out: Path) -> None:
    """Only an earlier export (or an empty directory) is ever replaced: nothing else is deleted."""
    if not os.path.lexists(out):
        return
    if out.is_dir() and ((out / "model_index.json").is_file() or not any(out.iterdir())):
        return  # (a link to an export: the link is replaced, the export it points to stays)
    raise FileExistsError(f"{out} exists and is not a diffusers export: choose another --output")


def _readme(info: dict[str, Any], cfg: dict[str, Any], notes: list[str]) -> str:
    n_classes = cfg["num_classes"]
    vae_line = {
        "included": {
            "scaling_factor": "`vae/`: the store's VAE, `scaling_factor` set to the store's scale factor.",
            "post_quant_conv": "`vae/`: the store's VAE with the store's latent transform folded into its "
            "`post_quant_conv` (`scaling_factor` 1): `vae.decode` takes the model's latents as they are.",
            "unchanged": "`vae/`: the store's VAE, its own `scaling_factor` (the store's transform is unknown).",
        }[info.get("latent_transform_in_vae") or "unchanged"],
        "pixels": "no `vae/`: the model generates pixels (values in [-1, 1]), there is nothing to decode.",
        "missing": f"no `vae/`: the model's VAE `{info['vae']}` could not be written offline ({info.get('vae_note')}).",
    }[info["vae_status"]]
    vae_arg = {
        "included": "",
        "pixels": ", vae=PixelDecoder()",
        "missing": f', vae=AutoencoderKL.from_pretrained("{info["vae"]}")',
    }[info["vae_status"]]
    imports = {
        "included": "",
        "pixels": "from dit_lightning.checkpoints import PixelDecoder  # identity decode, scaling_factor 1\n",
        "missing": "from diffusers import AutoencoderKL\n",
    }[info["vae_status"]]
    guidance = "1.5" if n_classes == 1000 else "1.0"
    guidance_note = (
        []
        if n_classes == 1000
        else [f"# DiTPipeline's null class is hard-coded to 1000: no guidance for {n_classes} classes"]
    )
    lines = [
        f"# DiT exported by dit-lightning ({info['weights']} weights of `{info['source']}`)",
        "",
        f"- architecture: depth {cfg['depth']}, hidden {cfg['hidden_size']}, {cfg['num_heads']} heads, patch "
        f"{cfg['patch_size']}, {cfg['in_channels']} x {cfg['input_size']} x {cfg['input_size']} inputs, "
        f"{n_classes} classes, learned sigma: {cfg['learn_sigma']}",
        f"- `scheduler/`: {info['scheduler_class']} with the training betas ({info['noise_schedule']}, "
        f"{info['diffusion_steps']} steps)" + (", clamping x0 to [-1, 1]" if info.get("thresholding") else ""),
        f"- {vae_line}",
        "",
        "## Load",
        "",
        "```python",
        "from diffusers import DiTPipeline",
        "from dit_lightning.checkpoints import use_reference_timestep_embedding",
        *([imports.rstrip("\n")] if imports else []),
        f'pipe = use_reference_timestep_embedding(DiTPipeline.from_pretrained("DIR"{vae_arg}))',
        *guidance_note,
        f"images = pipe(class_labels=[0, 1, 2], num_inference_steps=25, guidance_scale={guidance}).images",
        "```",
        "",
        "Without dit-lightning, the same exact network in plain diffusers:",
        "",
        "```python",
        "for block in pipe.transformer.transformer_blocks:",
        "    block.norm1.emb.time_proj.downscale_freq_shift = 0",
        "```",
        "",
        "diffusers' `DiTTransformer2DModel` builds its timestep frequencies with `downscale_freq_shift=1`",
        "(exponent / 127 instead of / 128 for 256 channels); the DiT this was trained as uses 0. Loaded as",
        "diffusers builds it, the outputs differ slightly (see dit-lightning's docs/sampling.md for the",
        "measured effect); with the line above they are the trained network's.",
        "",
    ]
    if info["vae_status"] == "pixels":
        lines += [
            "`PixelDecoder` is an identity `decode` with `config.scaling_factor = 1`; without dit-lightning,",
            "any module with those two (and `device` / `dtype` properties) does.",
            "",
        ]
    if notes:
        lines += ["## Notes", "", *[f"- {n}" for n in notes], ""]
    return "\n".join(lines)


def export_diffusers(
    ckpt: DiTCheckpoint,
    output: Union[str, Path],
    weights: Weights = "ema",
    scheduler: DiffusersSampler = "dpm++2m",
    store: Optional[str] = None,
    vae: Optional[str] = None,
) -> dict[str, Any]:
    """Write ``ckpt`` as a ``DiTPipeline`` directory (see the module docstring); returns what was
    written (``vae_status``: ``included`` | ``pixels`` | ``missing``) and notes for the user.

    ``store``: the latent store the model trained on, for its class names (``id2label``), VAE and
    scale factor; default the one a Lightning checkpoint records, when it is on this machine.
    ``vae``: override the VAE (hub id, local directory, or ``none/pixels``).
    Raises :class:`~.diffusers_format.NotExpressibleError` for a DiT diffusers cannot express.
    """
    import diffusers

    token_dim = infer_dit_config(ckpt.weights(weights), f"'{ckpt.path}'").get("class_token_dim")
    if token_dim:  # before the objective: this is what no DiTPipeline can hold, whatever it samples with
        raise NotExpressibleError(
            f"'{ckpt.path}' has REG's class token (class_token_dim {token_dim}: cls_embedder and "
            "final_layer.linear_cls), which diffusers' DiTTransformer2DModel has no place for: "
            f"{_ARCH_REASON_HINT}"
        )
    objective = objective_from_record(ckpt.args)
    if objective is not None and not objective.takes_epsilon_schedulers:
        raise NotExpressibleError(
            f"'{ckpt.path}' is a model trained with {objective.describe()}: DiTPipeline samples epsilon-prediction "
            "diffusion models with diffusers' DDPM-family schedulers, and would read its output as epsilon at "
            "DDPM timesteps. Export it with --format reference, safetensors or raw, and sample it with "
            f"dit-lightning's samplers ({', '.join(objective.samplers)})"
        )
    out = Path(output)
    sd = ckpt.weights(weights)
    cfg, notes = dit_config_of(ckpt, sd)
    transformer_config = diffusers_transformer_config(cfg)  # refuses what diffusers cannot express
    _check_pos_embed(sd, cfg, f"'{ckpt.path}'")
    mapped = to_diffusers_state_dict(sd)
    with torch.device("meta"):  # checks every name and shape without allocating the network
        model: Any = diffusers.DiTTransformer2DModel(**transformer_config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    got = {k: tuple(v.shape) for k, v in mapped.items()}
    if expected != got:  # pragma: no cover - the rule and diffusers disagree: a diffusers change
        bad = sorted(set(expected) ^ set(got)) or [k for k in expected if expected[k] != got[k]]
        raise RuntimeError(f"the name rule no longer matches diffusers' DiTTransformer2DModel: {bad[:4]}")

    spec = _store_spec(ckpt, store)
    vae_name = vae or recorded_vae(ckpt.args) or (spec.vae if spec is not None else None)
    if vae_name is None:
        vae_name = DEFAULT_VAE if cfg["in_channels"] == 4 else "none/pixels"
        notes.append(f"the checkpoint names no VAE; assumed {vae_name}")
    pixels = is_pixel_space(vae_name)
    scale = ckpt.args.get("scale_factor")
    if scale is None and spec is not None and not pixels:
        scale = spec.scale_factor
    # the checkpoint's latent transform, else its store's; unknown: the VAE keeps its own scaling_factor
    transform = transform_of(ckpt.args)
    if transform is None and spec is not None and not pixels:
        transform = spec.transform
    if transform is None and scale is not None and not pixels:
        transform = legacy_transform(vae_name, scale)
    ddpm = objective if isinstance(objective, DDPMObjective) else DDPMObjective()  # a raw file: DiT's
    noise_schedule, diffusion_steps = ddpm.noise_schedule, ddpm.diffusion_steps
    thresholding = pixels and can_threshold(scheduler)
    if pixels and not thresholding:
        notes.append(
            f"{scheduler} cannot clamp x0 to [-1, 1] in diffusers; DiTPipeline samples this pixel model unclipped"
        )
    sched = build_scheduler(scheduler, noise_schedule, diffusion_steps, learn_sigma=False, thresholding=thresholding)
    used = "ema" if weights == "ema" and ckpt.has_ema() else "raw"
    if weights == "ema" and not ckpt.has_ema():
        notes.append(f"'{ckpt.path}' has no EMA weights; exported the trained weights")

    with replace_directory(out) as tmp:
        _check_replaceable(out)  # before the work: an interrupted earlier export is recovered by now
        (tmp / "transformer").mkdir()
        model.save_config(str(tmp / "transformer"))
        data = _safetensors_bytes(mapped, {"format": "pt"})
        atomic_write(tmp / "transformer" / WEIGHT_FILE, lambda f: f.write(data))
        sched.save_pretrained(str(tmp / "scheduler"))
        vae_note = None
        recorded_as = "unchanged"
        if pixels:
            status = "pixels"
        else:
            vae_note, recorded_as = _write_vae(vae_name, transform, tmp / "vae")
            status = "missing" if vae_note else "included"
            if vae_note:
                notes.append(f"no vae/ written: {vae_note}; pass vae=AutoencoderKL.from_pretrained({vae_name!r})")
                if transform is not None and (transform.kind != "scale" or transform.shift):
                    notes.append(
                        f"that VAE does not invert the latent transform ({transform.describe()}) by itself: decode "
                        "with dit-lightning (`dit-lightning sample`), or export where the VAE can be read"
                    )
                elif scale is not None and float(scale) != DEFAULT_SCALE_FACTOR:
                    notes.append(f"set that VAE's scaling_factor to the store's {scale} (its default may differ)")
            elif transform is None:
                notes.append(
                    "the store's scale factor is unknown (pass store=...): vae/ keeps the VAE's own scaling_factor"
                )
            elif recorded_as == "post_quant_conv":
                notes.append(
                    f"the latent transform ({transform.describe()}) is folded into vae/'s post_quant_conv, "
                    "scaling_factor 1: DiTPipeline's decode inverts it"
                )
        index: dict[str, Any] = {
            "_class_name": "DiTPipeline",
            "_diffusers_version": diffusers.__version__,
            "scheduler": ["diffusers", type(sched).__name__],
            "transformer": ["diffusers", "DiTTransformer2DModel"],
            "vae": ["diffusers", "AutoencoderKL"] if status == "included" else [None, None],
        }
        if spec is not None and len(spec.class_names) == cfg["num_classes"]:
            index["id2label"] = {str(i): name for i, name in enumerate(spec.class_names)}
        elif spec is None:
            notes.append("no store known (pass store=...): model_index.json has no id2label")
        else:
            notes.append(
                f"the store has {len(spec.class_names)} class names for {cfg['num_classes']} classes: no id2label"
            )
        write_json(tmp / "model_index.json", index)
        info: dict[str, Any] = {
            "format_version": 1,
            "source": ckpt.path,
            "weights": used,
            "model_config": cfg,
            "noise_schedule": noise_schedule,
            "diffusion_steps": diffusion_steps,
            "vae": vae_name,
            "vae_status": status,
            "vae_note": vae_note,
            "scale_factor": None if pixels else (float(scale) if scale is not None else None),
            "latent_transform": transform.record() if transform is not None else None,
            "latent_transform_in_vae": recorded_as,
            "scheduler": scheduler,
            "scheduler_class": type(sched).__name__,
            "thresholding": thresholding,
            **{k: ckpt.meta[k] for k in ("epoch", "global_step") if isinstance(ckpt.meta.get(k), int)},
        }
        write_json(tmp / INFO_FILE, info)
        write_text(tmp / "README.md", _readme(info, cfg, notes))
    return {"output": str(out), **info, "notes": notes}
