"""Three scripts written as PAI-Rapidformer's public examples write them; only their import
line names ``rapidformer.compat.pai`` (the tests check that swapping it is the one change).

Each writes what it measured to ``--result-file`` (its own flag, through
``extra_args_provider``) on rank 0.
"""

PAI_IMPORT = "from rapidformer import"
OUR_IMPORT = "from rapidformer.compat.pai import"

FINETUNE = """
import json
import os

import torch
from transformers import AutoModelForSequenceClassification, AutoTokenizer

from rapidformer import Finetuner, RapidformerEngine, get_args


def read_split(directory, name, tokenizer, labels):
    rows = [json.loads(line) for line in open(os.path.join(directory, name))]
    return [dict(tokenizer(r["text"]), labels=labels.index(r["label"])) for r in rows]


class MyFinetuner(Finetuner):
    def __init__(self, engine):
        super().__init__(engine=engine)

    def train_valid_test_datasets_provider(self):
        args = get_args()
        tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path)
        labels = ["sells", "paints", "finds", "carries"]
        train = read_split(args.data_dir, "train.jsonl", tokenizer, labels)
        valid = read_split(args.data_dir, "validation.jsonl", tokenizer, labels)

        def collate_fn(examples):
            return tokenizer.pad(examples, return_tensors="pt")

        return train, valid, None, collate_fn

    def model_optimizer_lr_scheduler_provider(self):
        args = get_args()
        model = AutoModelForSequenceClassification.from_pretrained(
            args.pretrained_model_name_or_path, num_labels=4
        )
        return model, None, None

    def run_forward_step(self, batch, model):
        return model(**batch).loss

    def run_compute_metrics(self, model, eval_dataloader):
        model = model[0]
        hits = []
        for batch in eval_dataloader:
            logits = model(**batch).logits
            hits.append((logits.argmax(-1) == batch["labels"]).float())
        hits = self.gather(torch.cat(hits))
        return {"accuracy": hits.mean().item(), "eval_samples": hits.numel()}


def extra_args(parser):
    group = parser.add_argument_group(title="my fine-tuning")
    group.add_argument("--result-file", type=str)
    return parser


if __name__ == "__main__":
    engine = RapidformerEngine(extra_args_provider=extra_args)
    trainer = MyFinetuner(engine=engine)
    metrics = trainer.train()
    if get_args().rank == 0:
        json.dump(metrics, open(get_args().result_file, "w"))
"""

PRETRAIN = '''
import json
from functools import partial

import torch
import torch.nn.functional as F

from rapidformer import PreTrainer, RapidformerEngine, get_args, mpu


class Sequences(torch.utils.data.Dataset):
    """Token sequences that follow a fixed random transition table: learnable."""

    def __init__(self, count, seed, vocab=64, length=16):
        generator = torch.Generator().manual_seed(seed)
        table = torch.randint(0, vocab, (vocab,), generator=torch.Generator().manual_seed(0))
        start = torch.randint(0, vocab, (count,), generator=generator)
        rows = [start]
        for _ in range(length):
            rows.append(table[rows[-1]])
        self.tokens = torch.stack(rows, 1)

    def __len__(self):
        return len(self.tokens)

    def __getitem__(self, index):
        return {"text": self.tokens[index]}


class TinyLM(torch.nn.Module):
    def __init__(self, vocab=64, hidden=32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        layer = torch.nn.TransformerEncoderLayer(hidden, 4, 64, dropout=0.0, batch_first=True)
        self.body = torch.nn.TransformerEncoder(layer, 2)
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, tokens):
        causal = torch.nn.Transformer.generate_square_subsequent_mask(tokens.shape[1])
        return self.head(self.body(self.embed(tokens), mask=causal, is_causal=True))


def loss_func(labels, output_tensor):
    loss = F.cross_entropy(output_tensor.flatten(0, 1), labels.flatten())
    return loss, {"lm loss": loss.detach()}


class MyPreTrainer(PreTrainer):
    def __init__(self, engine):
        super().__init__(engine=engine)

    def train_valid_test_datasets_provider(self, train_val_test_num_samples):
        train, valid, test = train_val_test_num_samples
        return Sequences(train, seed=1), Sequences(max(valid, 8), seed=2), None

    def model_optimizer_lr_scheduler_provider(self):
        torch.manual_seed(get_args().seed)
        model = TinyLM()
        optimizer = torch.optim.AdamW(model.parameters(), lr=get_args().lr, weight_decay=0.0)
        return model, optimizer, None

    def run_forward_step(self, data_iterator, model):
        data = next(data_iterator) if data_iterator is not None else None
        tokens = mpu.broadcast_data(["text"], data, torch.int64)["text"]
        output_tensor = model(tokens[:, :-1])
        return output_tensor, partial(loss_func, tokens[:, 1:])


if __name__ == "__main__":
    engine = RapidformerEngine()
    trainer = MyPreTrainer(engine=engine)
    trainer.train()
'''

LOOP = """
import json
from functools import partial

import torch
from torch.utils.data import DataLoader
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from transformers import get_linear_schedule_with_warmup

from rapidformer import RapidformerEngine, get_args


def extra_args(parser):
    parser.add_argument("--result-file", type=str)
    return parser


engine = RapidformerEngine(extra_args_provider=extra_args)
args = get_args()
torch.manual_seed(args.seed)
tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path)
model = AutoModelForSequenceClassification.from_pretrained(
    args.pretrained_model_name_or_path, num_labels=4
)
labels = ["sells", "paints", "finds", "carries"]
rows = [json.loads(line) for line in open(args.data_dir + "/train.jsonl")]
dataset = [dict(tokenizer(r["text"]), labels=labels.index(r["label"])) for r in rows]


def collate_fn(examples):
    return tokenizer.pad(examples, padding="longest", return_tensors="pt")


train_dataloader = DataLoader(
    dataset, shuffle=True, collate_fn=collate_fn, batch_size=args.micro_batch_size
)
optimizer = torch.optim.AdamW(params=model.parameters(), lr=args.lr)
lr_scheduler = partial(
    get_linear_schedule_with_warmup,
    num_warmup_steps=args.lr_warmup_iters,
    num_training_steps=args.train_iters,
)
model, optimizer, lr_scheduler, train_dataloader, _ = engine.compose(
    model=model, train_dataloader=train_dataloader, optimizer=optimizer,
    lr_scheduler_fn=lr_scheduler,
)
losses, rates = [], []
while len(losses) < args.train_iters:
    model.train()
    for step, batch in enumerate(train_dataloader):
        outputs = model(**batch)
        loss = outputs.loss
        engine.backward(loss)
        lr_scheduler.step()
        applied = optimizer.step()
        optimizer.zero_grad()
        if applied is not None:
            losses.append(applied.loss)
            rates.append(lr_scheduler.get_last_lr()[0])
        if len(losses) == args.train_iters:
            break
if args.rank == 0:
    json.dump({"losses": losses, "rates": rates}, open(args.result_file, "w"))
"""
