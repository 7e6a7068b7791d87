"""K/V format pairs the format matrices of the tests run beside the single formats:
KVSpec(format="<k>/<v>") stores K in one format and V in another (docs/formats.md,
"K/V pairs"). llama.cpp's everyday -ctk q8_0 -ctv q4_0, a float K with 4-bit V, and an
8-bit K with float V."""
PAIRS = ["q8_0/q4_0", "f16/q4_0", "int8/f16"]


def sides(fmt: str) -> tuple[str, str]:
    """(K format, V format) of a format name or a pair name."""
    k, _, v = fmt.partition("/")
    return k, v or k
