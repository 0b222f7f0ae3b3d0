//! Deterministic pseudo-text. Prompts must have exact, reproducible byte
//! lengths (the mock counts 1 token per 4 bytes and hashes fixed-size blocks),
//! differ between sessions and tenants (or everything would share a prefix),
//! and still look like words, so logs and captures stay readable.

use crate::rng::{derive, Rng};

/// Bytes per token, the mock's convention.
pub const BYTES_PER_TOKEN: usize = 4;

/// Syllables the words are built from; 64 of them so a word carries plenty of
/// entropy and two independent streams practically never agree for long.
const SYLLABLES: [&str; 64] = [
    "ba", "be", "bi", "bo", "da", "de", "di", "do", "fa", "fe", "fi", "fo", "ga", "ge", "gi", "go",
    "ka", "ke", "ki", "ko", "la", "le", "li", "lo", "ma", "me", "mi", "mo", "na", "ne", "ni", "no",
    "pa", "pe", "pi", "po", "ra", "re", "ri", "ro", "sa", "se", "si", "so", "ta", "te", "ti", "to",
    "va", "ve", "vi", "vo", "za", "ze", "zi", "zo", "tha", "sho", "chi", "qua", "ven", "lor",
    "mun", "dar",
];

/// Seed tag of block-id text, so block streams never coincide with others.
const BLOCK_STREAM: u64 = 0xb10c;

/// Appends words from `rng` to `out` until it holds exactly `len` bytes
/// (ASCII only, so any cut is a valid `str` boundary).
pub fn fill(rng: &mut Rng, out: &mut String, len: usize) {
    while out.len() < len {
        let syllables = 1 + rng.below(3);
        for _ in 0..syllables {
            out.push_str(SYLLABLES[rng.below(SYLLABLES.len() as u64) as usize]);
        }
        // Roughly one sentence end every dozen words.
        out.push_str(if rng.below(12) == 0 { ". " } else { " " });
    }
    out.truncate(len);
}

/// `tokens` tokens (4 bytes each) of pseudo-text from the stream `seed`.
pub fn words(seed: u64, tokens: u64) -> String {
    let len = tokens as usize * BYTES_PER_TOKEN;
    let mut out = String::with_capacity(len);
    fill(&mut Rng::new(seed), &mut out, len);
    out
}

/// The text of block `id`: exactly `block_tokens * 4` bytes, a function of
/// `id` alone. It starts with the id in base 36 and a space, a prefix-free
/// code, so two ids always give different blocks whenever that code fits in
/// the block (ids below 36^(4*block_tokens-1); every id for 16-token blocks).
pub fn push_block(out: &mut String, id: u64, block_tokens: u32) {
    let len = block_tokens as usize * BYTES_PER_TOKEN;
    let mut block = String::with_capacity(len + 16);
    push_base36(&mut block, id);
    block.push(' ');
    fill(&mut Rng::new(derive(BLOCK_STREAM, &[id])), &mut block, len);
    out.push_str(&block);
}

/// The concatenated text of `ids`, each block `block_tokens` tokens.
pub fn blocks(ids: &[u64], block_tokens: u32) -> String {
    let mut out = String::with_capacity(ids.len() * block_tokens as usize * BYTES_PER_TOKEN);
    for &id in ids {
        push_block(&mut out, id, block_tokens);
    }
    out
}

fn push_base36(out: &mut String, mut n: u64) {
    const DIGITS: &[u8; 36] = b"0123456789abcdefghijklmnopqrstuvwxyz";
    let mut buf = [0u8; 13];
    let mut i = buf.len();
    loop {
        i -= 1;
        buf[i] = DIGITS[(n % 36) as usize];
        n /= 36;
        if n == 0 {
            break;
        }
    }
    out.extend(buf[i..].iter().map(|&b| char::from(b)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn words_have_exact_length_and_repeat() {
        for tokens in [0, 1, 7, 250] {
            let text = words(42, tokens);
            assert_eq!(text.len(), tokens as usize * 4);
            assert!(text.is_ascii());
            assert_eq!(text, words(42, tokens));
        }
        assert_ne!(words(1, 64), words(2, 64));
        // A longer text from the same stream extends the shorter one.
        assert!(words(5, 100).starts_with(&words(5, 10)));
    }

    #[test]
    fn block_text_is_exact_and_deterministic() {
        for bt in [1, 4, 16, 512] {
            let len = bt as usize * 4;
            let text = blocks(&[3, 9, 3], bt);
            assert_eq!(text.len(), 3 * len);
            assert_eq!(&text[..len], &text[2 * len..], "same id, same bytes");
            assert_eq!(text, blocks(&[3, 9, 3], bt));
        }
        let one = blocks(&[3], 16);
        assert!(one.starts_with("3 "), "{one}");
        assert!(blocks(&[u64::MAX], 16).starts_with("3w5e11264sgsf "));
    }

    #[test]
    fn different_ids_give_different_blocks() {
        let mut seen = std::collections::HashSet::new();
        for id in 0..5000u64 {
            assert!(seen.insert(blocks(&[id], 2)), "id {id} collides");
        }
        // Ids whose base-36 forms share a prefix are still told apart.
        assert_ne!(blocks(&[1], 16), blocks(&[36], 16));
        assert_ne!(blocks(&[1], 16), blocks(&[37], 16));
    }
}
