"""What the tests share, in one place: `from helpers.run import ...` (pytest puts tests/, the folder of the
root conftest.py, on sys.path; the test folders have no __init__.py, so test file names are unique).

  paths        the repository root; scripts of launch/ and benchmarks/ loaded as modules
  tolerances   relative tolerances by dtype; `assert_tree_close`
  meshes       mesh shapes with every axis 1 unless given; small meshes on the first devices
  metrics      a run directory's metrics.jsonl
  data         synthetic packed batches; small corpora on disk, a BPE tokenizer, the prepare command
  run          a small fp32 config, meshes over it and a 3-step run to compare; FAST_RUN
  faults       a tiny trained run directory, snapshots of files, a full disk
  hf           a small random Hugging Face Llama and its logits, a small tokenizer
  terminal     a command under a pseudo-terminal and what it wrote there
  imports      the package's import graph by module and by package, a circle in it
"""
