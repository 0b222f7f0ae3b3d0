//! Keyed 64-bit hashing of routing keys (SipHash-1-3).
//!
//! The affinity table never stores a raw routing key: it stores this hash. The hash is keyed by a
//! configurable secret seed so that outsiders cannot choose keys that all land in one bucket and
//! evict everyone else's pins. SipHash is the standard answer to hash flooding; the 1-3 variant is
//! what Rust's own `HashMap` uses and costs tens of nanoseconds for a typical key.

/// The MurmurHash3 64-bit finaliser: a bijection that spreads every input bit over the output.
/// Not keyed by itself; callers mix it with keyed values (rendezvous weights, prefix blocks).
#[inline]
pub fn fmix64(mut x: u64) -> u64 {
    x ^= x >> 33;
    x = x.wrapping_mul(0xff51_afd7_ed55_8ccd);
    x ^= x >> 33;
    x = x.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    x ^ (x >> 33)
}

/// A SipHash-1-3 key derived once from the configured seed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KeyedHasher {
    k0: u64,
    k1: u64,
}

/// Fixed key used to derive the real key from the seed string (and used as-is for an empty seed).
const DERIVE_K0: u64 = 0x6470_2d61_6666_696e; // "dp-affin"
const DERIVE_K1: u64 = 0x6974_792d_7631_2e30; // "ity-v1.0"

impl KeyedHasher {
    /// Derives the hashing key from a seed of any length.
    pub fn from_seed(seed: &[u8]) -> Self {
        if seed.is_empty() {
            return KeyedHasher {
                k0: DERIVE_K0,
                k1: DERIVE_K1,
            };
        }
        let base = KeyedHasher {
            k0: DERIVE_K0,
            k1: DERIVE_K1,
        };
        // Two domain-separated hashes of the seed give the two key halves.
        KeyedHasher {
            k0: base.hash_parts(b"k0", seed),
            k1: base.hash_parts(b"k1", seed),
        }
    }

    /// Hashes one byte string.
    pub fn hash(&self, data: &[u8]) -> u64 {
        self.hash_parts(&[], data)
    }

    /// Hashes `prefix ++ data` without concatenating them first.
    fn hash_parts(&self, prefix: &[u8], data: &[u8]) -> u64 {
        let mut s = SipState::new(self.k0, self.k1);
        let total = prefix.len() + data.len();
        let mut tail = 0u64;
        let mut ntail = 0usize;
        for part in [prefix, data] {
            let mut rest = part;
            // Finish a partial word left by the previous part.
            while ntail != 0 && !rest.is_empty() {
                tail |= u64::from(rest[0]) << (8 * ntail);
                ntail = (ntail + 1) % 8;
                rest = &rest[1..];
                if ntail == 0 {
                    s.compress(tail);
                    tail = 0;
                }
            }
            let mut words = rest.chunks_exact(8);
            for w in &mut words {
                let mut b = [0u8; 8];
                b.copy_from_slice(w);
                s.compress(u64::from_le_bytes(b));
            }
            for &byte in words.remainder() {
                tail |= u64::from(byte) << (8 * ntail);
                ntail += 1;
            }
        }
        s.finish(tail | ((total as u64 & 0xff) << 56))
    }
}

struct SipState {
    v0: u64,
    v1: u64,
    v2: u64,
    v3: u64,
}

impl SipState {
    fn new(k0: u64, k1: u64) -> Self {
        SipState {
            v0: k0 ^ 0x736f_6d65_7073_6575,
            v1: k1 ^ 0x646f_7261_6e64_6f6d,
            v2: k0 ^ 0x6c79_6765_6e65_7261,
            v3: k1 ^ 0x7465_6462_7974_6573,
        }
    }

    #[inline(always)]
    fn round(&mut self) {
        self.v0 = self.v0.wrapping_add(self.v1);
        self.v1 = self.v1.rotate_left(13) ^ self.v0;
        self.v0 = self.v0.rotate_left(32);
        self.v2 = self.v2.wrapping_add(self.v3);
        self.v3 = self.v3.rotate_left(16) ^ self.v2;
        self.v0 = self.v0.wrapping_add(self.v3);
        self.v3 = self.v3.rotate_left(21) ^ self.v0;
        self.v2 = self.v2.wrapping_add(self.v1);
        self.v1 = self.v1.rotate_left(17) ^ self.v2;
        self.v2 = self.v2.rotate_left(32);
    }

    #[inline(always)]
    fn compress(&mut self, m: u64) {
        self.v3 ^= m;
        self.round();
        self.v0 ^= m;
    }

    fn finish(mut self, last: u64) -> u64 {
        self.compress(last);
        self.v2 ^= 0xff;
        self.round();
        self.round();
        self.round();
        self.v0 ^ self.v1 ^ self.v2 ^ self.v3
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reference SipHash-1-3 over one contiguous buffer, written the textbook way.
    fn reference(k0: u64, k1: u64, data: &[u8]) -> u64 {
        let mut s = SipState::new(k0, k1);
        let mut chunks = data.chunks_exact(8);
        for c in &mut chunks {
            s.compress(u64::from_le_bytes(c.try_into().unwrap()));
        }
        let mut last = (data.len() as u64 & 0xff) << 56;
        for (i, &b) in chunks.remainder().iter().enumerate() {
            last |= u64::from(b) << (8 * i);
        }
        s.finish(last)
    }

    #[test]
    fn matches_std_siphash13_vectors() {
        // std's DefaultHasher is SipHash-1-3 with keys (0, 0); `write` of a byte slice hashes exactly
        // those bytes, so the two must agree for every length across word boundaries.
        #[allow(deprecated)]
        fn std_hash(data: &[u8]) -> u64 {
            use std::hash::Hasher;
            let mut h = std::collections::hash_map::DefaultHasher::new();
            h.write(data);
            h.finish()
        }
        let data: Vec<u8> = (0u8..64).collect();
        for len in 0..data.len() {
            assert_eq!(
                reference(0, 0, &data[..len]),
                std_hash(&data[..len]),
                "len {len}"
            );
        }
    }

    #[test]
    fn split_parts_equal_concatenation() {
        let h = KeyedHasher::from_seed(b"secret");
        let data: Vec<u8> = (0u8..40).collect();
        for cut in 0..data.len() {
            assert_eq!(
                h.hash_parts(&data[..cut], &data[cut..]),
                reference(h.k0, h.k1, &data),
                "cut {cut}"
            );
        }
    }

    #[test]
    fn seed_changes_every_hash() {
        let a = KeyedHasher::from_seed(b"");
        let b = KeyedHasher::from_seed(b"other");
        assert_ne!(a, b);
        for key in ["", "user-1", "conversation-42"] {
            assert_ne!(a.hash(key.as_bytes()), b.hash(key.as_bytes()));
        }
        assert_eq!(a.hash(b"x"), KeyedHasher::from_seed(b"").hash(b"x"));
    }
}
