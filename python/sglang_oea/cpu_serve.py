"""Command-line entry: `python -m sglang_oea.cpu_serve ...` runs sglang_oea.cpu.serve.main."""

from sglang_oea.cpu.serve import main

if __name__ == "__main__":
    main()
