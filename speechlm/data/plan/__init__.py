"""`speechlm plan`: show one epoch's plan before training on it.

Builds the sampler training builds (`speechlm.data.sampler.build`: the same settings, token cost model,
dataset mix and, when ``data.read_mode`` streams, the streaming plan) and prints its epoch:

- micro-batches per dp rank and optimizer steps per epoch (micro-batches / grad_accum);
- audio hours per optimizer step, summed over all dp ranks;
- the language mix of the plan (utterances and hours) next to the natural and the target shares;
- per duration bucket: utterances, micro-batches, hours;
- the padding efficiency (real tokens / computed tokens) of a padded BSHD batch, which computes
  B * max_len per micro-batch, and of a packed THD batch, which computes the sum of the lengths
  plus the CP/TP rounding of `speechlm.packing.thd.round_lengths`. Token counts per utterance follow
  the sampler's token cost model (audio + prompt) plus its estimate of the text tokens,
  ceil(characters / CHARS_PER_TOKEN), when the manifest has a `text` column.

`--json FILE` writes the summary plus `ranks`: one list per dp rank of micro-batches, each a list
of manifest row indices, in consumption order.

Four modules: `inputs` reads what is planned (durations, languages, text lengths of any source),
`figures` computes the summary (a JSON-ready dict), `report` prints it (and the lockstep-trim warning
training prints too), `cli` is the subcommand (arguments, then read → plan → summarize → print).
"""

from speechlm.data.plan.cli import add_parser
from speechlm.data.plan.report import trim_warning

__all__ = ["add_parser", "trim_warning"]
