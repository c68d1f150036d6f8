"""Token-id parity of kvq's BpeTokenizer (bench/eval/bpe_tokenizer.h) with the
Hugging Face `tokenizers` library.

The reference tokenizer is built from the eval model's own GGUF vocabulary and
merges (read with the `gguf` package) and the pre-tokenizer of SmolLM2's
tokenizer.json: Sequence[Digits(individual_digits), ByteLevel(regex)]. The C++
side runs through kvq_tokenize_tool (path in $KVQ_TOKENIZE_TOOL, set by CTest),
which reads one hex-encoded string per line and prints "ids<TAB>hex(decode)".

Strings: hand-written cases, plus seeded random slices of the text under the
eval data dir's corpora/ when scripts/fetch_eval_data.sh has filled it.
"""

import os
import pathlib
import random
import subprocess

import gguf
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

MODEL_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
CORPUS_SLICES = 200
LONG_SLICE_CHARS = 200_000


def eval_data_dir() -> pathlib.Path:
    # Mirrors EvalDataDir() in bench/eval/eval_data.cc.
    if os.environ.get("KVQ_EVAL_DATA"):
        return pathlib.Path(os.environ["KVQ_EVAL_DATA"])
    if os.environ.get("XDG_CACHE_HOME"):
        return pathlib.Path(os.environ["XDG_CACHE_HOME"]) / "kvq" / "eval"
    return pathlib.Path(os.environ.get("HOME", ".")) / ".cache" / "kvq" / "eval"


def eval_model_path() -> pathlib.Path:
    if os.environ.get("KVQ_EVAL_MODEL"):
        return pathlib.Path(os.environ["KVQ_EVAL_MODEL"])
    return eval_data_dir() / MODEL_FILE_NAME


HAND_WRITTEN = [
    # English and punctuation.
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    "Hello world",
    " leading space",
    "Punctuation!!! ??? ... --- (parens) [brackets] {braces}",
    "Well... I don't know -- maybe?",
    "\"Quoted\" and 'single-quoted' text; colons: semicolons;",
    # Contractions, which the pattern matches case-sensitively.
    "I'm sure they'll say it's fine, don't you think? We've seen it. I'd go.",
    "DON'T SHOUT, I'M HERE. IT'S OK, YOU'RE FINE, WE'VE, THEY'LL, I'D",
    "rock 'n' roll, 'tis the season, the dogs' bowls, ''s",
    "'s 't 're 've 'm 'll 'd 'x",
    # Numbers: every digit is its own piece.
    "12345",
    "3.14159 and 1,000,000 and -42 and 1e-9",
    "2024-01-01T12:34:56Z",
    "a  1 b\t2 c\n3  ",
    "Call 555-0123 or +1 (800) 555-0199.",
    "x² + y³ = z⁴, ½ + ¾, Ⅻ o'clock, ①②③",
    "Arabic-Indic ١٢٣٤ Devanagari १२३ fullwidth １２３ ＡＢＣ",
    # Letters of several scripts (combining marks are not \p{L}).
    "Élève café naïve résumé façade Ångström",
    "Straße Größe Übermut",
    "Привет, мир! Як справи?",
    "Καλημέρα κόσμε",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "你好，世界！这是一个测试。",
    "こんにちは世界。カタカナ ー",
    "안녕하세요 세계",
    "สวัสดีชาวโลก",
    "e\u0301 combining acute, a\u0308\u0304 stacked",
    # Emoji and other symbols.
    "Hello 👋🌍!",
    "👨‍👩‍👧‍👦 family, 👍🏽 thumbs, 🇫🇷🇺🇸 flags, ❤️ heart",
    "∑∫√∞ ≤ ≥ ≠ ± → ←",
    "€100 £50 ¥1000 ₹20 $5",
    # Whitespace runs, trailing spaces, tabs, newlines.
    "",
    " ",
    "   ",
    "a    b",
    "end   ",
    "   start",
    "\tindented\t\tx\t",
    "line1\nline2\n\n\nline3\n",
    "a\r\nb\r\n",
    "  \n  \t x",
    "\u00a0non-breaking\u00a0space \u3000ideographic\u2028line\u2029para\u0085nel",
    "\x1c\x1d\x1e\x1f separators that are not whitespace",
    "\x00nul\x07bell\x7fdel",
    "soft\u00adhyphen zero\u200bwidth join\u200d",
    " " * 100 + "x",
    "\n" * 20,
    # Code with indentation.
    "def foo(x):\n    return x ** 2  \n\n\nclass Bar:\n\tpass\n",
    "int main() {\n  for (int i = 0; i < 10; ++i) {\n    printf(\"%d\\n\", i);\n  }\n}\n",
    '{"key": [1, 2, 3], "nested": {"a": null, "b": true}}',
    "<html><body class=\"x\">Hi &amp; bye</body></html>",
    "https://example.com/path?q=1&r=two#frag user@example.org",
    "| col1 | col2 |\n|------|------|\n| 1    | 2    |",
    # Control-token text is plain text here.
    "<|im_start|>user\nHi<|im_end|>\n<|endoftext|>",
    # Long words and runs.
    "supercalifragilisticexpialidocious antidisestablishmentarianism",
    "a" * 64,
    "!!!!!!????........,,,,",
    "SGVsbG8gV29ybGQhIFRoaXMgaXMgYmFzZTY0IGVuY29kZWQ=",
    "0xDEADBEEF 0b1010 0o777",
    # Edge code points: private use, noncharacter, the last code point.
    "\ue000 private \uffff non \U0010ffff last",
    # Letters and digits assigned in Unicode 16 (Garay, Tulu-Tigalari, Kirat
    # Rai), and digits only the digit splitter knows (Unicode 17).
    "\U00010d4a\U00010d4b \U00011380\U00011381 \U00016d40\U00016d70\U00016d71",
    "x\U00011de0\U00011de1y \U00016ff4z",
]


@pytest.fixture(scope="module")
def reference():
    path = eval_model_path()
    if not path.is_file():
        pytest.fail(f"eval model {path} is missing: run scripts/fetch_eval_data.sh")
    return smollm_tokenizer(path)


def smollm_tokenizer(path):
    """(Hugging Face `tokenizers` Tokenizer, bytes it drops) built from the
    GGUF's vocabulary and merges with SmolLM2's pre-tokenizer (digits split,
    then GPT-2's pattern): the reference kvq's BpeTokenizer is checked
    against. (transformers' own GGUF tokenizer conversion leaves out the
    digit split.)"""
    reader = gguf.GGUFReader(str(path))

    def strings(key):
        field = reader.fields[key]
        return [bytes(field.parts[i]).decode("utf-8") for i in field.data]

    def scalar(key):
        field = reader.fields[key]
        value = field.parts[field.data[0]]
        return value if field.types[0] == gguf.GGUFValueType.STRING else value[0]

    assert bytes(scalar("tokenizer.ggml.model")).decode() == "gpt2"
    assert bytes(scalar("tokenizer.ggml.pre")).decode() == "smollm"
    tokens = strings("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ")) for m in strings("tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    # No added/special tokens: like Encode(), "<|im_start|>" in the text is
    # tokenized as ordinary text.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    # Bytes whose byte-level symbol the vocab lacks: both sides drop them.
    symbols = bytes_to_unicode()
    dropped = {b for b in range(256) if symbols[b] not in vocab}
    return tok, dropped


def bytes_to_unicode():
    """GPT-2's byte -> printable character table."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


def corpus_slices():
    corpora = eval_data_dir() / "corpora"
    if not corpora.is_dir():
        return []
    texts = [p.read_bytes().decode("utf-8", errors="replace")
             for p in sorted(corpora.glob("*.txt")) if p.is_file()]
    texts = [t for t in texts if t]
    if not texts:
        return []
    rng = random.Random(20240917)
    # One long stretch of each corpus (a realistic document), then short
    # random slices that start and end anywhere, mid-word included.
    slices = []
    for text in texts:
        start = rng.randrange(0, max(1, len(text) - LONG_SLICE_CHARS))
        slices.append(text[start:start + LONG_SLICE_CHARS])
    for _ in range(CORPUS_SLICES):
        text = rng.choice(texts)
        length = min(len(text), rng.choice([1, 2, 5, 20, 100, 500, 2000, 8000]))
        start = rng.randrange(0, len(text) - length + 1)
        slices.append(text[start:start + length])
    return slices


def run_tool(strings):
    tool = os.environ.get("KVQ_TOKENIZE_TOOL")
    if not tool:
        pytest.fail("KVQ_TOKENIZE_TOOL is not set: run this test through ctest "
                    "(python_tokenizer_parity)")
    stdin = "".join(s.encode("utf-8").hex() + "\n" for s in strings)
    proc = subprocess.run([tool], input=stdin.encode(), capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr.decode(errors="replace")
    lines = proc.stdout.decode().split("\n")
    assert lines[-1] == ""
    lines = lines[:-1]
    assert len(lines) == len(strings)
    results = []
    for line in lines:
        ids, decoded = line.split("\t")
        results.append(([int(x) for x in ids.split()], bytes.fromhex(decoded)))
    return results


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_ids_match_reference(reference):
    tok, dropped = reference
    strings = HAND_WRITTEN + corpus_slices()
    results = run_tool(strings)
    mismatches = []
    for s, (ids, decoded) in zip(strings, results):
        want = tok.encode(s, add_special_tokens=False).ids
        if ids != want:
            at = first_difference(ids, want)
            mismatches.append(f"{s[:80]!r}: from id #{at}: kvq {ids[at:at + 10]} "
                              f"reference {want[at:at + 10]}")
        kept = bytes(b for b in s.encode("utf-8") if b not in dropped)
        if decoded != kept:
            mismatches.append(f"{s[:80]!r}: Decode(Encode(s)) != s")
        elif tok.decode(ids) != kept.decode("utf-8"):
            mismatches.append(f"{s[:80]!r}: the reference decodes the ids differently")
    print(f"compared {len(strings)} strings ({len(HAND_WRITTEN)} hand-written)")
    assert not mismatches, f"{len(mismatches)} mismatches:\n" + "\n".join(mismatches[:20])


def test_tool_rejects_bad_hex():
    tool = os.environ.get("KVQ_TOKENIZE_TOOL")
    if not tool:
        pytest.fail("KVQ_TOKENIZE_TOOL is not set")
    proc = subprocess.run([tool], input=b"zz\n", capture_output=True, timeout=60)
    if "fetch_eval_data" in proc.stderr.decode(errors="replace"):
        pytest.fail(proc.stderr.decode(errors="replace"))
    assert proc.returncode != 0
