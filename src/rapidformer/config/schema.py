"""The typed configuration: one frozen dataclass per concern.

Every field is one command-line flag: the flag is the field name with ``-`` for ``_``
(``micro_batch_size`` -> ``--micro-batch-size``), so a flag is reachable exactly one way. The
string under each field is its documentation; :mod:`rapidformer.config.fields` reads it to build
the argument parser's help and ``docs/parameters.md``, so code, ``--help`` and docs cannot drift.

A leaf: it imports nothing of rapidformer. The whole config, :class:`~rapidformer.config.root.
RapidformerConfig`, holds one of each section (:mod:`rapidformer.config.root`). Nothing here
reads the environment or the world size: that is the validation's job, at run time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

TokenizerType = Literal["BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer"]
DataImpl = Literal["lazy", "cached", "mmap", "infer"]
DataIterator = Literal["dynamic-shape", "fixed-shape"]
Task = Literal[
    "sequence_classification",
    "token_classification",
    "question_answering",
    "masked_lm",
    "casual_lm",
    "causal_lm",
    "seq2seq_lm",
    "pretraining",
]
DecayStyle = Literal["constant", "linear", "cosine"]
Precision = Literal["fp32", "fp16", "bf16", "fp8"]
Fp8Recipe = Literal["tensorwise", "rowwise"]
OptimizerName = Literal["apex_adam", "apex_lamb"]
CompileMode = Literal["default", "reduce-overhead", "max-autotune"]
CompileScope = Literal["blocks", "model"]
ZeroBackend = Literal["native", "deepspeed"]
Sharding = Literal["none", "zero1", "zero2", "zero3"]
RecomputeGranularity = Literal["full", "selective"]
RecomputeMethod = Literal["uniform", "block"]
PipelineSchedule = Literal["1F1B", "GPipe", "Interleaved1F1B", "ZBV"]
TokenDropPolicy = Literal["probs", "position"]
LoadBalancing = Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "expert_bias", "none"]
ScoreFunction = Literal["softmax", "sigmoid"]
LoraVariant = Literal["lora", "dora", "rslora"]
BaseQuantization = Literal["nf4"]


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """What is fed to the model and in which batch sizes."""

    micro_batch_size: int = 1
    """Samples one rank feeds one forward pass."""
    global_batch_size: int | None = None
    """Samples per optimizer step over all data-parallel ranks; must be a multiple of
    micro-batch-size x data-parallel size, the quotient being the gradient-accumulation steps.
    Default: micro-batch-size x data-parallel size (no accumulation)."""
    tokenizer_type: TokenizerType | None = None
    """Tokenizer of the pretraining data."""
    split: str = "969, 30, 1"
    """Relative train, validation and test weights of the pretraining corpus, by document."""
    data_impl: DataImpl = "mmap"
    """How the indexed (.bin/.idx) pretraining data is read; infer detects it from the files."""
    data_path: str | None = None
    """Prefix of the indexed pretraining data, or a weighted blend "0.3 A 0.7 B"."""
    data_dir: str | None = None
    """Fine-tuning dataset: a dataset directory, a builder name, or a folder of files."""
    data_name: str | None = None
    """Fine-tuning dataset configuration or file name inside --data-dir."""
    vocab_file: str | None = None
    """Vocabulary file of the tokenizer (WordPiece vocab.txt or GPT-2 vocab.json)."""
    merge_file: str | None = None
    """BPE merges file of the GPT-2 tokenizer."""
    data_iterator: DataIterator = "fixed-shape"
    """fixed-shape: batches padded as the data's collate function pads them (the built-in
    templates pad to --seq-length); dynamic-shape: batches grouped by length and padded to a
    small set of length buckets."""
    chat_template: str | None = None
    """A Jinja chat template file (as tokenizer_config.json's chat_template) to render chat
    data with, instead of the tokenizer's own: for a model that has none. Causal LM only."""
    train_on_inputs: bool = False
    """Chat and instruction data: take the loss on every token (the prompts and the other
    turns too), not only on the assistant's turns or the completions."""
    drop_unsupervised: bool = False
    """Chat and instruction data: leave out the samples that --seq-length cuts before any
    token to learn (counted in the log), instead of refusing the data."""
    packing: bool = False
    """Causal LM fine-tuning: lay the samples end to end in rows of --seq-length tokens
    (best-fit decreasing), each with positions from 0 and attending only to itself (a
    block-diagonal mask), instead of padding each one."""
    reset_position_ids: bool = False
    """Built-in GPT pretraining: positions restart at 0 after each end-of-document token
    (Megatron's flag of the same name)."""
    reset_attention_mask: bool = False
    """Built-in GPT pretraining: a token attends only to the tokens of its own document (the
    end-of-document token ends it), through a block-diagonal causal mask (Megatron's)."""
    eod_mask_loss: bool = False
    """Built-in GPT pretraining: no loss where the input is the end-of-document token (the
    next document's first token is not predicted from the last one's end; Megatron's)."""


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Which transformer to train and its shape."""

    pretrained_model_name_or_path: str | None = None
    """Directory (or hub name) of a pretrained Hugging Face model to fine-tune."""
    num_layers: int | None = None
    """Transformer layers of a model built from scratch."""
    hidden_size: int | None = None
    """Hidden dimension of a model built from scratch."""
    num_attention_heads: int | None = None
    """Attention heads per self-attention layer."""
    max_position_embeddings: int | None = None
    """Longest sequence the position embeddings cover."""
    seq_length: int | None = None
    """Sequence length of the training samples."""
    hidden_dropout: float = 0.1
    """Dropout probability inside the built-in GPT and BERT models (0 makes runs exactly
    comparable across data-parallel sizes)."""
    trust_remote_code: bool = False
    """Let transformers run the Python files of --pretrained-model-name-or-path (a model whose
    config.json maps its classes to code in the directory or on the hub); off by default, as
    in transformers. The run plan names it."""


@dataclass(frozen=True, kw_only=True)
class TrainingConfig:
    """The task, the schedule and how long to train."""

    task: Task | None = None
    """What the black-box CLI trains (causal_lm is accepted for the reference spelling
    casual_lm)."""
    lr: float | None = None
    """Peak learning rate; required when rapidformer builds the optimizer."""
    lr_decay_style: DecayStyle = "linear"
    """Decay of the learning rate after warmup, down to --min-lr at the last step."""
    lr_warmup_fraction: float | None = None
    """Fraction of the training steps spent warming the learning rate up linearly from 0."""
    lr_warmup_iters: int = 0
    """Steps spent warming the learning rate up (alternative to --lr-warmup-fraction)."""
    min_lr: float = 0.0
    """Learning rate reached at the end of the decay."""
    weight_decay: float = 0.01
    """Decoupled weight decay; never applied to biases and normalisation weights."""
    clip_grad: float = 1.0
    """Maximum global gradient norm; 0 disables clipping."""
    train_iters: int | None = None
    """Optimizer steps to train for (iteration-based training)."""
    epochs: int | None = None
    """Passes over the training set (epoch-based training)."""
    eval_interval: int | None = None
    """Evaluate every this many steps; evaluation always runs at the end when there is
    validation data."""
    eval_iters: int | None = None
    """Validation batches per evaluation; default: the whole validation set."""
    seed: int = 1234
    """Seed of every random number generator (model init, dropout, data order)."""
    user_script: str | None = None
    """Python file defining a Trainer, Pretrainer or Finetuner subclass for the CLI to run."""
    max_skipped_steps: int = 10
    """Stop the run after this many consecutive steps skipped for a non-finite loss or
    gradient (on any rank; fp16 loss-scale overflows count too). A skipped step changes no
    parameter, optimizer state or learning rate."""


@dataclass(frozen=True, kw_only=True)
class PrecisionConfig:
    """Numeric precision of the forward and backward passes."""

    precision: Precision = "fp32"
    """Autocast precision: fp32 (off), fp16 (with a loss scaler; also spelled
    --mixed-precision), bf16, or fp8 (bf16 autocast plus float8 matmuls in the linear layers
    through torchao; GPUs of compute capability 8.9 or newer, with the rapidformer[gpu]
    extra)."""
    fp8_recipe: Fp8Recipe = "tensorwise"
    """torchao's float8 scaling under --precision fp8: tensorwise (one scale per tensor, the
    fastest) or rowwise (one per row, more accurate)."""

    @property
    def autocast(self) -> Precision:
        """The autocast precision: fp8 runs the model under bf16 autocast (its float8 matmuls
        are the converted linear layers' own)."""
        return "bf16" if self.precision == "fp8" else self.precision


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """Model-parallel degrees; the data-parallel degree is what the world size leaves."""

    tensor_model_parallel_size: int = 1
    """Tensor-parallel degree: each layer's matrices split over this many ranks."""
    pipeline_model_parallel_size: int = 1
    """Pipeline-parallel degree: the layers split into this many stages."""
    sequence_parallel: bool = False
    """With tensor parallelism, also shard the LayerNorm and dropout regions along the sequence
    (Megatron's sequence parallelism): their activations take 1/tp of the memory, and each
    all-reduce becomes a reduce-scatter plus an all-gather."""
    pipeline_schedule: PipelineSchedule = "1F1B"
    """Pipeline schedule: 1F1B and GPipe hold one stage per rank; Interleaved1F1B (Megatron's
    interleaving) and ZBV (zero-bubble, V-shaped) hold several virtual stages per rank."""
    pipeline_layer_split: str | None = None
    """Layers per pipeline stage, comma-separated (e.g. 3,5 for 8 layers on 2 stages; one entry
    per virtual stage); default: a balanced split that counts the embedding and the head as
    one layer each."""
    num_layers_per_virtual_pipeline_stage: int | None = None
    """Layers in each virtual pipeline stage (Megatron's flag): every rank then holds
    layers / (pipeline size x this) stages. Interleaved1F1B and ZBV default to 2 stages per
    rank."""
    distributed_timeout_minutes: float = 10.0
    """How long a rank waits in a collective for its peers before the run fails with a message
    naming the rank that is missing (the process group's timeout)."""


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """Memory optimisations: model-state sharding, offload and activation checkpointing."""

    sharding: Sharding = "none"
    """Model state sharded over the data-parallel ranks (ZeRO): zero1 shards the optimizer
    state, zero2 the gradients too, zero3 the parameters too; through --zero-backend. Also
    spelled as PAI-Rapidformer's flags: --zero-1-memory-optimization or
    --oss-memory-optimization (zero1), --zero-2-memory-optimization or
    --oss-sdp-memory-optimization (zero2), --zero-3-memory-optimization or
    --fsdp-memory-optimization (zero3)."""
    zero_backend: ZeroBackend = "native"
    """Engine behind --sharding: native (PyTorch ZeroRedundancyOptimizer and FSDP2) or
    deepspeed (the DeepSpeed engine runs ZeRO stage 1/2/3, backward and the optimizer step;
    needs the rapidformer[deepspeed] extra)."""
    cpu_offload: bool = False
    """Keep sharded model state in CPU memory (needs --sharding); with --zero-backend
    deepspeed, ZeRO-Offload of the optimizer state (and of the parameters at stage 3)."""
    recompute_granularity: RecomputeGranularity | None = None
    """Recompute activations in the backward pass (Megatron's flag): full (a layer's whole
    forward again, keeping only its input) or selective (an op-level policy: matrix
    multiplications and attention keep their outputs, pointwise ops and norms are recomputed).
    --checkpoint-activations (Megatron's and PAI-Rapidformer's flag) means full."""
    recompute_method: RecomputeMethod | None = None
    """Which layers recompute (needs --recompute-granularity and --recompute-num-layers):
    uniform (every layer, in chunks of --recompute-num-layers consecutive layers of which only
    the chunk's input is kept; full granularity only) or block (only the first
    --recompute-num-layers layers of each model part; the others keep everything)."""
    recompute_num_layers: int | None = None
    """Layers per chunk (--recompute-method uniform) or layers that recompute (block)."""
    fused_lm_loss: bool = False
    """Compute the LM head and its cross-entropy in chunks of tokens inside the model's forward,
    recomputing each chunk's logits in backward, so that all logits never exist at once
    (built-in GPT and BERT pretraining; Liger-Kernel's kernel on CUDA where installed)."""


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Sparsely gated mixture of experts (token-choice top-k routing, Megatron's flag names)."""

    num_experts: int | None = None
    """Experts per MoE layer; unset or 1 means dense feed-forward layers. The built-in GPT and
    BERT swap their FFN for an MoE layer (see --moe-layer-freq)."""
    moe_router_topk: int = 2
    """Experts each token is sent to."""
    moe_layer_freq: str = "1"
    """Which layers are MoE: 1 = every layer, k = every k-th (layers 0, k, 2k ...), or a
    Megatron pattern of one 0/1 per layer, e.g. [0,1,1,1] or 0,1,1,1."""
    moe_ffn_hidden_size: int | None = None
    """Hidden width of each expert's FFN; default: the dense FFN's."""
    moe_expert_capacity_factor: float | None = None
    """Each expert takes at most factor x tokens x topk / experts assignments per micro-batch
    (and rank); the rest are dropped (the token keeps its residual). Unset = dropless: no
    token is ever dropped."""
    moe_token_drop_policy: TokenDropPolicy = "probs"
    """Over capacity, which assignments an expert keeps: probs (highest router scores) or
    position (earliest tokens). Needs --moe-expert-capacity-factor."""
    moe_router_load_balancing_type: LoadBalancing = "aux_loss"
    """aux_loss: Switch/GShard loss E x sum_i f_i P_i over the micro-batch; seq_aux_loss: the
    same per sequence, averaged; global_aux_loss: over the whole global batch (f_i counted over
    every micro-batch and data-parallel rank in a no-grad routing pass before each step: one
    extra forward per step; not with pipeline parallelism); expert_bias: no loss, a per-expert
    bias used only to choose experts, moved every step towards even loads (DeepSeek-V3);
    none."""
    moe_aux_loss_coeff: float = 1e-2
    """Weight of the load-balancing loss (aux_loss / seq_aux_loss / global_aux_loss) in the
    objective."""
    moe_z_loss_coeff: float | None = None
    """Weight of the router z-loss mean(logsumexp(logits)^2) (ST-MoE); unset = off."""
    moe_router_score_function: ScoreFunction = "softmax"
    """Router scores: softmax over experts, or sigmoid per expert (the chosen top-k scores
    are then normalised to sum to 1)."""
    moe_router_bias_update_rate: float = 1e-3
    """expert_bias: how far each expert's bias moves per step (sign of its load error)."""
    expert_model_parallel_size: int = 1
    """Expert-parallel degree: each of these data-parallel ranks holds num_experts / size
    experts, tokens reach them by all-to-all. Must divide the data-parallel size."""
    moe_use_upcycling: bool = False
    """Start the MoE model from a dense one (--load of a dense checkpoint, or the Finetuner's
    --pretrained-model-name-or-path of a built-in export): every expert is a copy of its
    layer's dense FFN, the router starts at zero."""


@dataclass(frozen=True, kw_only=True)
class GraphConfig:
    """Graph-level optimisation of the model."""

    onnx_runtime_training: bool = False
    """Run the forward and backward passes in ONNX Runtime."""
    liger_kernel: bool = False
    """Hugging Face models on CUDA: Liger-Kernel's Triton kernels for RMSNorm, RoPE and SwiGLU,
    through Liger's patch for the model's family (needs the rapidformer[gpu] extra)."""
    torch_compile: bool = False
    """Compile each transformer block with torch.compile (after activation checkpointing,
    before data parallelism and sharding); with --data-iterator dynamic-shape one graph per
    length bucket."""
    torch_compile_mode: CompileMode = "default"
    """torch.compile's mode: default, reduce-overhead (CUDA graphs on GPUs) or max-autotune
    (benchmarks kernel choices; long compiles). Needs --torch-compile."""
    torch_compile_cache_dir: str | None = None
    """Directory for inductor's compiled-kernel cache (TORCHINDUCTOR_CACHE_DIR), reused by
    later runs; default: inductor's own. Needs --torch-compile."""
    torch_compile_scope: CompileScope = "blocks"
    """What --torch-compile compiles: blocks (each transformer block: short compiles, one
    graph shared by all blocks) or model (the whole model, its head included, and the
    template's compute_loss where the template owns the loss). Needs --torch-compile."""


@dataclass(frozen=True, kw_only=True)
class AdapterConfig:
    """Parameter-efficient fine-tuning: low-rank adapters on a frozen base, saved in PEFT's
    format (docs/adapters.md)."""

    lora_rank: int | None = None
    """Train low-rank adapters of this rank on the target linear layers instead of every
    weight (LoRA); the base is frozen. Off by default."""
    lora_alpha: float | None = None
    """The adapters' scale numerator: each adds alpha / rank x B(A(x)) (alpha / sqrt(rank) with
    --lora-variant rslora). Default: 2 x --lora-rank."""
    lora_dropout: float | None = None
    """Dropout on the adapters' input (the base sees the input unchanged). Default: 0, or the
    --lora-adapter's."""
    lora_target_modules: str | None = None
    """Linear layers that get adapters: all-linear (the default: every linear layer but the
    output head and the modules to save, as PEFT's all-linear), comma-separated module names (a
    name matches itself and every module path ending in .name), or a regular expression matched
    against the whole module path."""
    lora_variant: LoraVariant | None = None
    """lora (the default): alpha / rank scaling; dora: weight-decomposed LoRA (a trained
    magnitude per output feature, PEFT's use_dora); rslora: rank-stabilised alpha / sqrt(rank)
    scaling."""
    lora_modules_to_save: str | None = None
    """Comma-separated modules trained in full beside the adapters and saved with them.
    Default: the task's new head (classifier, score, qa_outputs) for sequence and token
    classification and question answering; none otherwise."""
    quantize_base: BaseQuantization | None = None
    """QLoRA: store the frozen linear weights in NF4 (torchao), dequantised layer by layer in
    forward and backward. Needs --lora-rank and --precision bf16."""
    lora_adapter: str | None = None
    """Start from the adapter in this directory (adapter_config.json and
    adapter_model.safetensors, as rapidformer or PEFT's save_pretrained write them) instead of
    fresh adapters; its rank, alpha, variant and targets are used unless the flags say
    otherwise."""


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """Which optimizer implementation steps the parameters."""

    optimizers: OptimizerName = "apex_adam"
    """apex_adam: AdamW (apex FusedAdam when built, else torch's fused AdamW); apex_lamb: LAMB
    (apex FusedLAMB when built, else rapidformer's multi-tensor LAMB). The plan names which."""


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    """Where training state is saved and resumed from."""

    save: str | None = None
    """Directory for checkpoints, metrics.jsonl and TensorBoard events; a run whose --save
    already holds a checkpoint resumes from it."""
    load: str | None = None
    """Checkpoint directory (or one iteration inside it) to resume from."""
    pretrained_checkpoint: str | None = None
    """A whole model's checkpoint (a --save directory, or one iteration inside it) whose
    weights a fresh run starts from, with a fresh optimizer at step 0: continued pretraining,
    or the frozen base that --lora-rank adapts on the Pretrainer's built-in models. Read again
    on every resume (a checkpoint of adapters holds no base)."""
    save_interval: int | None = None
    """Save every this many steps; a final checkpoint is always saved when --save is set, and
    one at the step reached when a stop signal (SIGTERM, SIGINT, SIGUSR1) arrives."""
    save_keep: int | None = None
    """Keep only the newest this many whole checkpoints under --save, and the one 'latest'
    names (default: keep all)."""
    async_save: bool = False
    """Write each interval's checkpoint in a background thread on every rank: the step waits
    only for a copy of the state in host memory (consolidated files, or this rank's DCP
    shards); at most one save in flight; 'latest' moves once every rank's files are complete
    and on disk; a failed write stops the run (on several ranks after a step they agree on).
    The last save and a stop signal's are synchronous. Refused with DeepSpeed's engine."""
    trust_checkpoint: bool = False
    """Load checkpoint files without scanning their pickles (--load, resuming from --save, a
    Hugging Face .bin, a dense checkpoint to upcycle): only for a checkpoint whose source you
    trust, since unpickling a crafted file can run any code. By default every pickle is
    scanned and anything but tensors, plain containers and the types checkpoints hold is
    refused (docs/checkpoints.md, Loading safely)."""


@dataclass(frozen=True, kw_only=True)
class LoggingConfig:
    """What rank 0 reports while training."""

    log_interval: int = 100
    """Log loss, learning rate, gradient norm, throughput, MFU and memory every this many
    steps."""
    peak_tflops: float | None = None
    """One device's peak TFLOP/s in the run's precision, the MFU denominator; default: a table
    of GPUs by name, or on a CPU a short matrix-multiply probe at start (its measured rate)."""
    debug: bool = False
    """Print the Python traceback of an error that ends a run (also RAPIDFORMER_DEBUG=1);
    by default the command prints one message naming the input and the fix."""
    verbose: bool = False
    """Show what third-party libraries print on their own (transformers' load reports and
    progress bars, DeepSpeed's and torchao's notices); by default a run prints its plan and its
    progress."""
    report_to: str = "tensorboard,jsonl"
    """Where rank 0 reports every logged row, the evaluation metrics, the resolved config and
    the run plan: a comma list of tensorboard, jsonl, mlflow, wandb and trackio, or all, or
    none (Hugging Face's spelling). TensorBoard and jsonl write under --save; mlflow, wandb
    and trackio need rapidformer[trackers] (docs/trackers.md)."""
    run_name: str | None = None
    """The run's name in MLflow, W&B and Trackio (default: WANDB_NAME for W&B, else the name of
    the --save directory)."""
    tracker_project: str | None = None
    """The MLflow experiment, W&B project and Trackio project the run goes to (default:
    MLFLOW_EXPERIMENT_NAME or WANDB_PROJECT where set, else rapidformer)."""
    mlflow_tracking_uri: str | None = None
    """Where MLflow records the run (a server's URL or a database URI; default: MLFLOW_TRACKING_URI
    where set, else a SQLite database under --save, SAVE/mlflow.db, with artifacts in
    SAVE/mlflow-artifacts)."""


@dataclass(frozen=True, kw_only=True)
class PlanningConfig:
    """Know before you run: a dry run of the same flags."""

    dry_run: bool = False
    """Validate the flags, compose every rank on the meta device over a fake process group and
    print the plan and each rank's memory (model state as the run's memory report counts it,
    buffers, activations), without allocating model memory, starting a process group or
    opening data files; with --save, also written to SAVE/dry_run.json."""
    dry_run_world_size: int | None = None
    """Ranks the dry run simulates; default: torchrun's WORLD_SIZE, else 1."""
    device_memory: str | None = None
    """Memory of one device for the dry run's fit check (e.g. 80GB, 24GiB; binary units); default:
    the GPU's own where there is one. A rank that does not fit gets the switches that would make
    it fit, with their estimates."""


SECTIONS: dict[str, type] = {
    "data": DataConfig,
    "model": ModelConfig,
    "training": TrainingConfig,
    "precision": PrecisionConfig,
    "parallel": ParallelConfig,
    "memory": MemoryConfig,
    "moe": MoEConfig,
    "graph": GraphConfig,
    "adapters": AdapterConfig,
    "optimizer": OptimizerConfig,
    "checkpoint": CheckpointConfig,
    "logging": LoggingConfig,
    "planning": PlanningConfig,
}
"""Section name in :class:`~rapidformer.config.root.RapidformerConfig` -> its dataclass, in
documentation order."""
