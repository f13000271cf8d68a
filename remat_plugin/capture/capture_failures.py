"""Why a capture failed, said for the user: the model's line, the torch.nn line beneath it, and the fix.

``torch.export`` and AOTAutograd raise their own exceptions from deep inside their tracers; each becomes a
:class:`CaptureError` that names where the model's code failed and, for the failures users meet (a key/value cache
returned, LayerDrop, a branch on an argument's values, Lightning's ``self.log``), what to change.
"""
from __future__ import annotations

import linecache
import re
from dataclasses import dataclass
from types import FrameType

import torch
from torch import nn

from remat_plugin.capture.graded_constants import passing_on
from remat_plugin.capture.tensor_checks import traced_line
from remat_plugin.errors import CaptureError


def _eager_experts(frame: FrameType | None) -> bool:
    """Whether ``frame`` runs transformers' eager experts loop: a method of a module its experts decorator built
    (``_is_expert_parallel`` is the decorator's) with the ``eager`` implementation."""
    module = frame.f_locals.get("self") if frame is not None else None
    return hasattr(module, "_is_expert_parallel") and \
        getattr(getattr(module, "config", None), "_experts_implementation", None) == "eager"


def _models(frame: FrameType, caller_file: str) -> bool:
    """Whether a failing trace's frame runs the model's code: not torch's, not the caller's, not one of the
    capture's function modes passing a call on (:func:`passing_on`)."""
    return "site-packages/torch" not in frame.f_code.co_filename and frame.f_code.co_filename != caller_file and \
        not passing_on(frame.f_code)


_LIGHTNING = re.compile(r"[/\\](pytorch_)?lightning[/\\]")


def _lightning_log(frames: list[FrameType], caller_file: str) -> tuple[str, FrameType] | None:
    """``(method, the frame that called it)`` where the failing trace ran Lightning's ``self.log``/``log_dict``."""
    for i, frame in enumerate(frames):
        if frame.f_code.co_name in ("log", "log_dict") and _LIGHTNING.search(frame.f_code.co_filename):
            callers = [f for f in frames[:i] if _models(f, caller_file) and not _LIGHTNING.search(f.f_code.co_filename)
                       and not f.f_code.co_filename.startswith("<")]
            if callers:
                return frame.f_code.co_name, callers[-1]
    return None


_TORCH_NN = "site-packages/torch/nn/"


def _layer_drops(module: nn.Module, user: list[FrameType]) -> list[str]:
    """The model's LayerDrop settings above zero (``layerdrop=0.1``), where the failing function reads one."""
    if not user:
        return []
    frame = user[-1]
    lines = linecache.getlines(frame.f_code.co_filename)[frame.f_code.co_firstlineno - 1 : frame.f_lineno]
    if "layerdrop" not in "".join(lines).lower():  # the failing function, up to the failing line
        return []
    config = getattr(module, "config", None)
    settings = vars(config) if config is not None and hasattr(config, "__dict__") else {}
    return [f"{k}={v}" for k, v in settings.items()
            if "layerdrop" in k.lower() and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0]


def _enclosing_lines(filename: str, lineno: int) -> list[str]:
    """The headers of the blocks around a line, innermost first, up to its function's ``def``: a data-dependent
    branch on a value computed from an argument (``if label_index.size(0) > 0:`` inside ``if labels is not None:``,
    DeBERTa's classification loss) names the argument there, not on the failing line."""
    def indent(text: str) -> int:
        return len(text) - len(text.lstrip())

    line = linecache.getline(filename, lineno)
    depth, headers = indent(line), []
    for n in range(lineno - 1, max(lineno - 200, 0), -1):
        text = linecache.getline(filename, n)
        if not text.strip() or text.lstrip().startswith(("#", ")", "]", "}")) or indent(text) >= depth:
            continue
        depth = indent(text)
        if text.lstrip().startswith(("def ", "async def ", "class ")):
            break
        headers.append(text.strip())
    return headers


def _may_be_the_argument(local: object, argument: torch.Tensor) -> bool:
    """Whether a value the failing frame holds under an argument's name may be that argument (export runs on fake
    copies of it, of its sizes and dtype): a library's own local of the same name is not (Pixtral's vision
    attention builds its own ``attention_mask`` from the image sizes)."""
    if not isinstance(local, torch.Tensor):
        return True  # not a local tensor there: read from elsewhere in that line, by the name the regex found
    sizes = tuple(local.shape)  # a size export holds symbolic (not an int) is no argument's: theirs are static
    return local.dtype == argument.dtype and len(sizes) == argument.dim() and \
        all(type(a) is int and a == b for a, b in zip(sizes, argument.shape))


@dataclass(frozen=True)
class _Failure:
    """Where in the model's code an export failed."""

    first: str  # the exception's first line
    frames: list[FrameType]  # the traceback's frames, outermost first
    user: list[FrameType]  # those of the model's code (not torch's, not the caller's)
    line: str  # the model's failing line
    library_line: str  # the torch.nn line beneath it, if any
    logged: tuple[str, FrameType] | None  # Lightning's self.log that the trace ran, and the line calling it


def export_failure(exc: Exception, module: nn.Module, kwargs: dict, caller_file: str) -> CaptureError:
    """The :class:`CaptureError` of a ``torch.export`` of ``module`` that raised ``exc`` in a call made from
    ``caller_file``, naming the model's line and the fix where one is known."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    tb, frames = exc.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame)
        tb = tb.tb_next
    user = [f for f in frames if _models(f, caller_file)]
    where = line = ""
    if user:
        f = user[-1]
        where = f" at {f.f_code.co_filename}:{f.f_lineno} ({f.f_code.co_name})"
        line = linecache.getline(f.f_code.co_filename, f.f_lineno)
    library = [f for f in frames[frames.index(user[-1]) + 1 if user else 0 :] if _TORCH_NN in f.f_code.co_filename]
    library_line = ""
    if library:  # the torch.nn module line that failed, beneath the model's (a BatchNorm's, a loss's)
        f = library[-1]
        library_line = linecache.getline(f.f_code.co_filename, f.f_lineno).strip()
        where += f", inside torch/nn/{f.f_code.co_filename.split(_TORCH_NN)[-1]}:{f.f_lineno}: {library_line}"
    logged = _lightning_log(frames, caller_file)
    if logged is not None:  # export failed deep in the logger (a deepcopy of a fake tensor): name the model's line
        f = logged[1]
        where = f" at {f.f_code.co_filename}:{f.f_lineno} ({f.f_code.co_name})"
    hint = _hint(exc, module, kwargs, _Failure(first, frames, user, line, library_line, logged))
    return CaptureError(
        f"remat_plugin.capture: torch.export could not capture {type(module).__name__}{where}: "
        f"{type(exc).__name__}: {first}{hint}"
    )


def _hint(exc: Exception, module: nn.Module, kwargs: dict, failure: _Failure) -> str:
    """The fix for a failure users meet, in parentheses, or ``""``."""
    first, logged = failure.first, failure.logged
    data_dependent = "data-dependent" in first or "DataDependent" in type(exc).__name__
    drops = _layer_drops(module, failure.user) if data_dependent else []
    if logged is not None:
        return (f" (the forward calls Lightning's self.{logged[0]}, which keeps the value it is given and cannot "
                "be traced: a planned step would not log. Return the value from the forward and log it in "
                "training_step)")
    if "cache_utils" in first or "Cache'> in output" in first:
        return (" (the model returns its key/value cache, which cannot be captured: a training step has no use "
                "for it; call the model with use_cache=False)")
    if "_ctc_loss" in first:
        return (" (the CTC loss sizes its work by the values of its lengths, which a traced graph cannot depend "
                "on: return the log-probabilities and compute F.ctc_loss outside the model, or call a "
                "transformers CTC model without labels=...)")
    if any(isinstance(v, nn.utils.rnn.PackedSequence) for f in failure.frames for v in f.f_locals.values()):
        return (" (a PackedSequence holds its batch sizes as a tensor made from the lengths' values, which a "
                "graph traced at fixed sizes cannot depend on: run the recurrent layer on the padded batch and "
                "mask the padding's outputs (a bidirectional layer's backward direction then also reads the "
                "padding), or train this model unplanned)")
    if "is not an instance of torch.nn.Parameter" in first:
        return (" (its parameters were swapped for plain tensors, as torch.func.functional_call and "
                "torch.nn.utils.stateless do: a planned step is traced on the module's own Parameters; call "
                "functional_call on the unplanned model, rm.original, or pass nn.Parameter values, each new set "
                "captured again)")
    if "num_batches_tracked" in failure.library_line:
        return (" (a BatchNorm built with momentum=None averages its statistics by its batch count, a buffer's "
                "value read at every step, which a traced graph cannot depend on: give it a momentum, such as "
                "the default 0.1)")
    if drops:
        return (f" (LayerDrop: the model draws at every step whether to skip each layer ({', '.join(drops)}), "
                "which a traced graph cannot follow: set " + " and ".join(f"config.{d.split('=')[0]} = 0.0"
                                                                          for d in drops) + " to plan it)")
    if data_dependent:
        return _data_dependent_hint(kwargs, failure)
    return ""


def _data_dependent_hint(kwargs: dict, failure: _Failure) -> str:
    """A branch or size on tensor values: the argument the failing line (or a block around it) reads, or
    transformers' eager experts loop."""
    blocks = _enclosing_lines(failure.user[-1].f_code.co_filename, failure.user[-1].f_lineno) if failure.user else []
    read = [name for name, value in kwargs.items() if isinstance(value, torch.Tensor)
            and any(re.search(rf"\b{re.escape(name)}\b", text) for text in [failure.line, *blocks])
            and _may_be_the_argument(failure.user[-1].f_locals.get(name), value)]
    if read:
        which = "that line" if re.search(rf"\b{re.escape(read[0])}\b", failure.line) else "the block that line is in"
        return (f" ({which} reads the values of {read[0]!r}, which a traced graph cannot depend on: where it "
                f"feeds only the loss, call the model without {read[0]}=... and compute the loss from its "
                "outputs; an input that sizes the model's work (image sizes, a count of images) keeps the "
                "model unplanned)")
    if _eager_experts(failure.user[-1] if failure.user else None):
        return (" (transformers' eager experts loop over the experts a batch routes to, a data-dependent "
                "count: build the model with experts_implementation=\"grouped_mm\" or \"batched_mm\", "
                "whose sizes do not depend on the routing)")
    return ""


# NOTE [untraceable graphs]
#     ``torch.export`` accepts graphs AOTAutograd cannot trace at fixed sizes: an op whose output size
#     depends on tensor values (boolean-mask indexing ``x[mask]``, ``nonzero``, ``unique``), which export
#     holds with an unbacked size, or an autograd Function whose backward reads a number from a tensor
#     (NOTE [autograd Functions]).  The trace happens at the step's first call, so such a model used to
#     fail there with the tracer's own exception.  It is now a :class:`CaptureError` naming the op and the
#     model's line, with the per-layer fallback where the model has repeated layers, as for an export that
#     fails.  Failures after the joint graph is handed to the planner are the planner's and stay as they are.
def untraceable(exc: Exception, exported: torch.fx.GraphModule | None, model: str) -> CaptureError:
    """The :class:`CaptureError` of an exported graph AOTAutograd could not trace (NOTE [untraceable graphs])."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    where = ""
    tb = exc.__traceback__
    generated = None
    while tb is not None:
        if tb.tb_frame.f_code.co_filename.startswith("<eval_with_key>"):
            generated = tb  # the innermost frame of the exported graph's code: the node that failed
        tb = tb.tb_next
    if generated is not None and exported is not None:
        line = linecache.getline(generated.tb_frame.f_code.co_filename, generated.tb_lineno).strip()
        name = line.split(" = ", 1)[0].split(",")[0].strip() if " = " in line else ""
        node = next((n for n in exported.graph.nodes if n.name == name), None)
        source = traced_line(node) if node is not None else None
        where = f" at {source}" if source else f" at `{line[:200]}`"
    hint = ""
    made_like = re.search(r"derivative for aten::(\w+_like) is not implemented", first)
    if made_like:
        hint = (f" (torch.{made_like.group(1)} of a tensor that requires grad: eager gives the result no gradient, "
                "the trace looks for one; call it on the tensor's .detach(), which computes the same)")
    elif "DynamicOutputShape" in type(exc).__name__ or "DataDependent" in type(exc).__name__ or \
            "data-dependent" in first:
        hint = (" (an op whose output size or a branch depends on tensor values, such as x[mask] with a boolean "
                "mask, nonzero or unique: a graph traced at fixed sizes cannot hold it; write it with sizes that "
                "do not depend on values, e.g. torch.where(mask, x, 0))")
    return CaptureError(f"remat_plugin.capture: the graph exported from {model or 'the model'} could not be traced"
                        f"{where}: {type(exc).__name__}: {first[:300]}{hint}")
