"""quantkit's benchmarks: one package, one harness (bench/harness.py), one entry point (`python -m bench`).

    python -m bench --list            # every bench module, one line each
    python -m bench NAME [args]       # run one bench (NAME --help for its arguments)
    python -m bench --smoke all       # every bench on its tiny case; says which were skipped and why
    python -m bench readme [--check]  # rewrite (check) bench/README.md's generated tables from bench/results/

Run from the repository root (quantkit installed in the venv). See bench/README.md.
"""
