"""Command-line entry: `python -m sglang_oea.tiny_model ...` runs sglang_oea.cpu.tiny_model.main."""

from sglang_oea.cpu.tiny_model import main

if __name__ == "__main__":
    main()
