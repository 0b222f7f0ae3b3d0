//! FNV-1a 64: a tiny, well-known hash so tests can check "exactly these body
//! bytes reached the upstream" without echoing (possibly megabytes of) body,
//! and the block hash of the simulated prefix cache (see `prompt`).

const OFFSET_BASIS: u64 = 0xcbf2_9ce4_8422_2325;
const PRIME: u64 = 0x0000_0100_0000_01b3;

/// FNV-1a 64 of `bytes`.
pub fn fnv1a64(bytes: &[u8]) -> u64 {
    fnv1a64_extend(OFFSET_BASIS, bytes)
}

/// Continues an FNV-1a 64 whose state is `hash` over `bytes`, so a hash over
/// several pieces needs no concatenated copy of them.
pub fn fnv1a64_extend(hash: u64, bytes: &[u8]) -> u64 {
    bytes
        .iter()
        .fold(hash, |hash, &b| (hash ^ u64::from(b)).wrapping_mul(PRIME))
}

/// The form used in the `mock.body_fnv1a64` field: 16 lowercase hex digits.
pub fn fnv1a64_hex(bytes: &[u8]) -> String {
    format!("{:016x}", fnv1a64(bytes))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reference_vectors() {
        // Vectors from the reference FNV test suite.
        assert_eq!(fnv1a64_hex(b""), "cbf29ce484222325");
        assert_eq!(fnv1a64_hex(b"a"), "af63dc4c8601ec8c");
        assert_eq!(fnv1a64_hex(b"foobar"), "85944171f73967e8");
    }

    #[test]
    fn extend_equals_one_pass() {
        let split = fnv1a64_extend(fnv1a64(b"foo"), b"bar");
        assert_eq!(split, fnv1a64(b"foobar"));
        assert_eq!(fnv1a64_extend(fnv1a64(b"x"), b""), fnv1a64(b"x"));
    }

    #[test]
    fn hex_is_zero_padded() {
        assert_eq!(fnv1a64_hex(b"").len(), 16);
        assert_eq!(fnv1a64_hex(&[0u8; 7]).len(), 16);
    }
}
