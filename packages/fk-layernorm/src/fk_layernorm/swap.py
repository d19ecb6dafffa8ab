"""`swap_norms(model)`: a model's LayerNorm / RMSNorm modules replaced in place by fk's, for
torch.nn's and for Hugging Face transformers' RMSNorm classes (matched by duck typing: transformers
is never imported)."""

from __future__ import annotations

import warnings

import torch

from .module import LayerNorm, RMSNorm


def _eps(module: torch.nn.Module):
    """A transformers RMSNorm's epsilon (`variance_epsilon` as Llama's, or `eps`), else None."""
    for name in ("variance_epsilon", "eps"):
        value = getattr(module, name, None)
        if isinstance(value, float):
            return value
    return None


def _is_hf_rms_norm(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return (type(module).__name__.endswith("RMSNorm") and isinstance(weight, torch.nn.Parameter)
            and weight.dim() == 1 and _eps(module) is not None)


def _computes_alike(module: torch.nn.Module, fk_module: torch.nn.Module) -> bool:
    """Whether `module` computes what torch's norm of `fk_module`'s kind and eps would with its
    weight and bias, tried on fixed rows (no random draw: the caller's generator stays as it was)."""
    weight, bias = getattr(module, "weight", None), getattr(module, "bias", None)
    n = fk_module.normalized_shape[0]
    device, dtype = (weight.device, weight.dtype) if weight is not None else (None, torch.float32)
    x = torch.linspace(-3.0, 2.0, 2 * n, device=device).view(2, n).to(dtype)
    w = None if weight is None else weight.float()
    with torch.no_grad():
        out = module.forward(x).float()  # not module(x): the norm's own hooks must not see the probe
        if isinstance(fk_module, LayerNorm):
            ref = torch.nn.functional.layer_norm(x.float(), (n,), w, None if bias is None else bias.float(),
                                                 fk_module.eps)
        else:
            ref = torch.nn.functional.rms_norm(x.float(), (n,), w, fk_module.eps)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    return out.shape == ref.shape and torch.allclose(out, ref, rtol=tol, atol=tol)


def _replacement(module: torch.nn.Module):
    """(fk module, None) for a norm fk computes alike, (None, why not) for a norm it does not, or
    (None, None) for any other module. The fk module holds meta placeholders for the parameters."""
    if isinstance(module, (torch.nn.LayerNorm, torch.nn.RMSNorm)):
        if len(module.normalized_shape) != 1:
            return None, f"normalizes over {len(module.normalized_shape)} dims (fk: the last dim only)"
        if isinstance(module, torch.nn.LayerNorm):
            new = LayerNorm(module.normalized_shape, module.eps, module.elementwise_affine,
                            bias=module.bias is not None, device="meta")
        else:
            new = RMSNorm(module.normalized_shape, module.eps, module.elementwise_affine, device="meta")
        # torch's own classes are known; a subclass may compute something else.
        needs_check = type(module) not in (torch.nn.LayerNorm, torch.nn.RMSNorm)
    elif _is_hf_rms_norm(module):
        new, needs_check = RMSNorm(module.weight.shape[0], _eps(module), device="meta"), True
    else:
        return None, None
    if needs_check and any(p.is_meta for p in module.parameters()):
        return None, "is on the meta device (what it computes cannot be checked)"
    if needs_check and not _computes_alike(module, new):
        return None, "computes something else than x / rms(x) * weight or torch's LayerNorm " \
            "(e.g. Gemma's x / rms(x) * (1 + weight))"
    return new, None


# torch.nn.Module's hook registries, carried over to a norm's replacement.
HOOKS = ("_forward_hooks", "_forward_hooks_with_kwargs", "_forward_hooks_always_called", "_forward_pre_hooks",
         "_forward_pre_hooks_with_kwargs", "_backward_hooks", "_backward_pre_hooks", "_is_full_backward_hook",
         "_state_dict_hooks", "_state_dict_pre_hooks", "_load_state_dict_pre_hooks", "_load_state_dict_post_hooks")


def swap_norms(model: torch.nn.Module) -> int:
    """Replace, in place, every `torch.nn.LayerNorm` and `torch.nn.RMSNorm` submodule of `model` and
    every transformers-style RMSNorm (a class named `*RMSNorm` with a 1-D `weight` and a float
    `variance_epsilon` or `eps`: Llama's, Mistral's, Qwen2's, ...) by `fk_layernorm.LayerNorm` /
    `RMSNorm` with the same eps, holding the very same weight and bias Parameters (optimizers and
    tied weights keep working); a norm held under several names becomes one fk module, and its
    hooks stay registered. Returns how many norms were replaced.

    Subclasses of torch's norms and transformers-style ones are first run once on fixed rows and
    swapped only if they compute what torch's norm would. Those that do not (Gemma's
    x / rms(x) * (1 + weight)), norms over several dims and unverifiable ones (meta device) stay as
    they are, named in one warning. `model` itself is never replaced, only its submodules."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    replaced, skipped = {}, {}  # by id: a norm held under several names becomes one fk module
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent._modules.items()):  # repeated children too
            if child is None:
                continue
            if id(child) not in replaced:
                new, why_not = _replacement(child)
                if why_not is not None and id(child) not in skipped:
                    skipped[id(child)] = (f"{parent_name + '.' if parent_name else ''}{name} "
                                          f"({type(child).__name__}) {why_not}")
                if new is None:
                    continue
                # The new module's placeholder parameters (meta) give way to the old module's own.
                for param in ("weight", "bias"):
                    if param in new._parameters:
                        new._parameters[param] = getattr(child, param)
                new.train(child.training)
                for hooks in HOOKS:  # the same dicts: hooks keep firing, their handles keep removing them
                    if hasattr(child, hooks):
                        setattr(new, hooks, getattr(child, hooks))
                replaced[id(child)] = new
            setattr(parent, name, replaced[id(child)])
    if skipped:
        warnings.warn("swap_norms left these norms as they are: " + "; ".join(skipped.values()), stacklevel=2)
    return len(replaced)
