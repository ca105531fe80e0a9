"""Entry point for SGLang's plugin loader (group `sglang.srt.plugins`)."""


def register() -> None:
    """Called by sglang.srt.plugins.load_plugins() in every SGLang process."""
    from sglang_oea import hooks

    hooks.install()
