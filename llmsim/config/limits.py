"""The documented limits on what llmsim reads, in one place (the table of docs/reference/input-limits.md).

Every file the tool reads passes :func:`llmsim.config.reader.read_text` (size and encoding),
every YAML file :func:`llmsim.config.reader.load_yaml` (nesting and alias expansion), and
every number a :class:`~llmsim.config.reader.Node` accessor (finite, within these maxima), so
a new setting gets the same checks without code of its own. The limits are far above any
real deployment; they exist so that a typo or a hostile file is refused in a clear paragraph
instead of overflowing a float, exhausting memory or recursing until Python gives up.
"""
from __future__ import annotations

# -- files -------------------------------------------------------------------------------
MAX_CONFIG_FILE_BYTES = 16 * 2**20      # a YAML or JSON file: the shipped ones are under 20 kB
MAX_TABLE_FILE_BYTES = 512 * 2**20      # a CSV trace: about 20 million rows of three columns
# Rows (lines) of a table or JSON-lines trace, counted before parsing: short lines ("0,1,1") fit
# 90 million in the byte cap, and every cell is a Python object once read.
MAX_TABLE_ROWS = 20_000_000
# Objects and lists ('{' and '[') of a JSON trace or dataset, counted before parsing: a Mooncake
# line has two, and each, however short its text, is 56 bytes or more once parsed.
MAX_JSON_CONTAINERS = 2 * MAX_TABLE_ROWS
MAX_TOKENIZER_FILE_BYTES = 64 * 2**20   # a Hugging Face tokenizer.json: large vocabularies take tens of MB

# -- YAML ----------------------------------------------------------------------------------
MAX_YAML_DEPTH = 64                 # nested mappings/lists; shipped files reach 5
MAX_YAML_ALIASES = 1_000            # uses of '*anchor'
MAX_YAML_NODES = 200_000            # values once every alias is expanded ("billion laughs" stop here)

# -- JSON -----------------------------------------------------------------------------------
MAX_JSON_DEPTH = 64                 # nested objects/arrays; a config.json reaches 3

# -- command lines -------------------------------------------------------------------------
MAX_FLAGS_CHARS = 64 * 1024         # engine.vllm_args / --vllm-args: a vllm serve command line is under 1 kB

# -- grids ---------------------------------------------------------------------------------
# Points of a sweep grid (the product of its lists' lengths), built before any runs: at about a
# second a point this is a day of one core, while a few lines of YAML could ask for billions.
MAX_GRID_POINTS = 100_000

# -- numbers -------------------------------------------------------------------------------
# A plain number: its magnitude at most 2**53, the largest integer a float64 holds exactly
# (counts, seeds and sizes beyond it would silently lose their last digits).
MAX_NUMBER = float(2**53)

# A quantity with a unit, in its base unit. Simulated time is float64 seconds: at 1e9 s
# (32 years) it still resolves 0.1 microsecond, beyond that latencies lose their digits.
# Bandwidth and compute go far higher than any device (a CS-3 is 1.25e17 FLOP/s) so that a test
# device can be "practically infinite" (1e27 FLOP/s) and still keep every product finite.
MAX_QUANTITY = {
    "duration": 1e9,                # seconds
    "bytes": 1e18,                  # 1 EB
    "bandwidth": 1e30,              # bytes/s
    "flops": 1e30,                  # FLOP/s
    "power": 1e9,                   # 1 GW
    "rate": 1e9,                    # requests per second
}

# -- a trace's columns ----------------------------------------------------------------------
MAX_TRACE_TOKENS = 10_000_000       # a request's prompt or output, above any model's context
# Characters per token when a dataset's tokens are estimated from its text: byte-level tokenizers
# give at most one token per UTF-8 byte (4 bytes a character at most), and no vocabulary has tokens
# of a thousand characters.
MIN_CHARS_PER_TOKEN = 0.25
MAX_CHARS_PER_TOKEN = 1000.0

# -- the resource guard (llmsim.sim.resources): a run estimated above these is refused unless forced --
MAX_RUN_MEMORY_BYTES = 16 * 2**30       # refused above this estimate, unless forced (it runs ~2-3x the peak)
MAX_RUN_EVENTS = 100_000_000            # about an hour at 25,000 iterations a second
# Each engine keeps its iteration log in memory maps of its own, and Linux allows a process 65,530
# maps by default (vm.max_map_count): 100,000 replicas fail to allocate whatever memory is free.
MAX_RUN_ENGINES = 20_000                # built and reported in about a minute
