"""Profiles of published models from their layer shapes, computed rather than measured.

    from pipesgd.planner.published import gnmt, vgg16
    prof = vgg16(batch_size=64)           # 16 layers, times at 5e12 multiply-adds/s
    prof = gnmt(batch_size=64, seq_len=50)

Each layer's figures follow from its shape (`LayerShape`, per sample):

- forward_s = batch x forward multiply-adds / `flops_per_s`; backward_s = 2 x forward_s
  (the gradients of the input and of the weights each cost about one forward).
- param_bytes = parameters x 4 (fp32); optimizer_bytes = `optimizer_copies` x that
  (SGD with momentum keeps 1 copy, Adam 2).
- output_bytes = batch x output elements x 4: what a stage boundary after it sends.
- saved_bytes = batch x elements autograd keeps for the backward x 4: the layer's input
  and output (the input is also its predecessor's output and counts in both, as
  `pipesgd.planner.profile` measures it), plus what the layer's kind keeps besides
  (an LSTM's gates and cell states, the attention weights).

"FLOPs" here are multiply-adds, the convention of the published figures (VGG-16: 15.5 G
at 224x224, as torchvision and most papers count it), and `flops_per_s` is in the same
unit. The default, 5e12 multiply-adds/s (10 TFLOP/s counting a multiply-add as two), is
a V100's fp32 rate at about 65 % of its 15.7 TFLOP/s peak, the GPUs of PipeDream's
clusters; a VGG-16 sample then takes 3.1 ms forward.
Element-wise work (ReLU, pooling, gate non-linearities, softmax) is not counted: it is
under 1 % of the multiply-adds for both models.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .profile import LayerProfile, ModelProfile

DEFAULT_FLOPS_PER_S = 5e12  # multiply-adds per second of one worker (10 TFLOP/s)
BACKWARD_RATIO = 2.0  # backward = input gradient + weight gradient, each ~ one forward
BYTES_PER_ELEMENT = 4  # fp32


@dataclass(frozen=True)
class LayerShape:
    """One layer, per sample.

    Attributes:
        name: for tables.
        flops: forward multiply-adds.
        params: parameters (weights and biases).
        output: elements of the output.
        saved: elements autograd keeps from the forward until the backward.
    """

    name: str
    flops: float
    params: int
    output: int
    saved: int


def from_shapes(
    shapes: Sequence[LayerShape],
    *,
    batch_size: int,
    flops_per_s: float = DEFAULT_FLOPS_PER_S,
    optimizer_copies: float = 1.0,
    source: str = "",
    model: str = "",
) -> ModelProfile:
    """The `ModelProfile` of `shapes` at `batch_size` samples per micro-batch (see the
    module docstring for the formulas). `extra` keeps the model name, the rate and the
    per-sample forward multiply-adds of each layer."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not flops_per_s > 0:
        raise ValueError(f"flops_per_s must be > 0, got {flops_per_s}")
    b, e = batch_size, BYTES_PER_ELEMENT
    layers = tuple(
        LayerProfile(
            forward_s=b * s.flops / flops_per_s,
            backward_s=BACKWARD_RATIO * b * s.flops / flops_per_s,
            output_bytes=float(b * s.output * e),
            param_bytes=float(s.params * e),
            optimizer_bytes=float(optimizer_copies * s.params * e),
            saved_bytes=float(b * s.saved * e),
            name=s.name,
        )
        for s in shapes
    )
    return ModelProfile(
        layers,
        batch_size=batch_size,
        source=source or f"analytic, {flops_per_s:.3g} multiply-adds/s",
        extra={"model": model, "flops_per_s": flops_per_s,
               "forward_flops_per_sample": [s.flops for s in shapes]},
    )


# --------------------------------------------------------------------------- VGG-16
VGG16_CONFIG = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M",
                512, 512, 512, "M", 512, 512, 512, "M")  # Simonyan & Zisserman, config D


def vgg16_shapes(image_size: int = 224, num_classes: int = 1000) -> list[LayerShape]:
    """VGG-16 (configuration D): 13 3x3 convolutions (padding 1, each with its ReLU and
    the 2x2 max-pool that follows it, if any) and 3 fully connected layers (4096, 4096,
    `num_classes`, with ReLU and dropout), 138,357,544 parameters at 1000 classes.

    A convolution costs 9 cin cout H W multiply-adds at its output's H x W; it keeps its
    input and its ReLU's full-resolution output (which the max-pool keeps as well), and
    sends the pooled output. A fully connected layer costs cin x cout.
    """
    if image_size % 32:
        raise ValueError(f"VGG-16 halves the image 5 times: image_size must be a multiple "
                         f"of 32, got {image_size}")
    out: list[LayerShape] = []
    cin, side = 3, image_size
    convs = 0
    for i, item in enumerate(VGG16_CONFIG):
        if item == "M":
            continue
        cout = int(item)
        convs += 1
        full = cout * side * side
        pooled = i + 1 < len(VGG16_CONFIG) and VGG16_CONFIG[i + 1] == "M"
        next_side = side // 2 if pooled else side
        out.append(LayerShape(
            name=f"conv{convs}" + ("+pool" if pooled else ""),
            flops=9.0 * cin * cout * side * side,
            params=9 * cin * cout + cout,
            output=cout * next_side * next_side,
            saved=cin * side * side + full,
        ))
        cin, side = cout, next_side
    dims = [cin * side * side, 4096, 4096, num_classes]
    for k in range(3):
        out.append(LayerShape(
            name=f"fc{k + 6}",
            flops=float(dims[k] * dims[k + 1]),
            params=dims[k] * dims[k + 1] + dims[k + 1],
            output=dims[k + 1],
            saved=dims[k] + dims[k + 1],
        ))
    return out


def vgg16(
    batch_size: int = 64,
    *,
    flops_per_s: float = DEFAULT_FLOPS_PER_S,
    optimizer_copies: float = 1.0,
    image_size: int = 224,
    num_classes: int = 1000,
) -> ModelProfile:
    """VGG-16 on ImageNet (`vgg16_shapes`), 16 layers. Defaults: PipeDream's per-GPU
    minibatch of 64 and its optimizer for VGG-16, SGD with momentum (1 copy of state)."""
    return from_shapes(
        vgg16_shapes(image_size, num_classes), batch_size=batch_size,
        flops_per_s=flops_per_s, optimizer_copies=optimizer_copies, model="vgg16",
        source=f"analytic VGG-16 at {image_size}x{image_size}, batch {batch_size}, "
               f"{flops_per_s:.3g} multiply-adds/s",
    )


# --------------------------------------------------------------------------- GNMT-like
def lstm_params(input_size: int, hidden: int) -> int:
    """One LSTM layer as PyTorch stores it: W_ih (4H x in), W_hh (4H x H), b_ih, b_hh."""
    return 4 * hidden * (input_size + hidden) + 8 * hidden


def gnmt_shapes(
    seq_len: int = 50,
    *,
    hidden: int = 1024,
    vocab: int = 32000,
    lstm_layers: int = 8,
) -> list[LayerShape]:
    """A GNMT-like chain (Wu et al. 2016, PipeDream's GNMT-8): embedding, `lstm_layers`
    unidirectional LSTMs of `hidden` units, one attention layer, and the projection to
    the vocabulary with its softmax. Per sample of `seq_len` tokens:

    - embedding (vocab x H): a row copied per token (S H, counted as multiply-adds so
      the layer has a time); keeps nothing but the token ids.
    - LSTM (`lstm_params`): 4H(in + H) multiply-adds per token; keeps its input and
      output sequences and, per token, the 4H gate activations and the H cell state
      (what cuDNN keeps for the backward).
    - attention, Luong's "general" score over the sequence: W_a (H x H) applied to every
      position (S H^2), scores and context (2 S^2 H), output tanh(W_c [context; h])
      (W_c 2H x H with bias, 2 S H^2); keeps its input, W_a h, the S x S weights, the
      context and the output.
    - softmax: the projection H x vocab with bias (S H V); keeps its input and the
      probabilities (S V), the largest activation of the model.

    GNMT proper has separate source and target embeddings, a bidirectional first encoder
    layer, residual connections and attention from decoder to encoder; a chain of one
    sequence keeps its sizes and costs without the graph.
    """
    h, s = hidden, seq_len
    out = [LayerShape("embedding", flops=float(s * h), params=vocab * h, output=s * h,
                      saved=s)]
    for i in range(lstm_layers):
        out.append(LayerShape(f"lstm{i + 1}", flops=float(s * 4 * h * (h + h)),
                              params=lstm_params(h, h), output=s * h,
                              saved=s * h + s * h + s * 5 * h))
    out.append(LayerShape("attention", flops=float(s * h * h + 2 * s * s * h + 2 * s * h * h),
                          params=h * h + 2 * h * h + h, output=s * h,
                          saved=s * h + s * h + s * s + s * h + s * h))
    out.append(LayerShape("softmax", flops=float(s * h * vocab), params=h * vocab + vocab,
                          output=s * vocab, saved=s * h + s * vocab))
    return out


def gnmt(
    batch_size: int = 64,
    seq_len: int = 50,
    *,
    flops_per_s: float = DEFAULT_FLOPS_PER_S,
    optimizer_copies: float = 2.0,
    hidden: int = 1024,
    vocab: int = 32000,
    lstm_layers: int = 8,
) -> ModelProfile:
    """The GNMT-like chain (`gnmt_shapes`), 11 layers. Defaults: PipeDream's per-GPU
    minibatch of 64, sentences of 50 tokens (GNMT's training cap), Adam (2 copies of
    state), as PipeDream trained GNMT."""
    return from_shapes(
        gnmt_shapes(seq_len, hidden=hidden, vocab=vocab, lstm_layers=lstm_layers),
        batch_size=batch_size, flops_per_s=flops_per_s, optimizer_copies=optimizer_copies,
        model="gnmt",
        source=f"analytic GNMT-like, {lstm_layers} LSTM x {hidden}, vocabulary {vocab}, "
               f"{seq_len} tokens, batch {batch_size}, {flops_per_s:.3g} multiply-adds/s",
    )


PUBLISHED: dict[str, Callable[..., ModelProfile]] = {"vgg16": vgg16, "gnmt": gnmt}

__all__ = [
    "BACKWARD_RATIO",
    "DEFAULT_FLOPS_PER_S",
    "PUBLISHED",
    "LayerShape",
    "from_shapes",
    "gnmt",
    "gnmt_shapes",
    "lstm_params",
    "vgg16",
    "vgg16_shapes",
]
