//! Counter names, defined once. Envoy shows wasm-defined metrics at its admin `/stats` under its own
//! prefix (see README, "Metrics").

/// Every counter the filter defines, in a fixed order (the host keeps an id per entry).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Counter {
    Explicit,
    AffinityHit,
    AffinityMiss,
    NoKey,
    Learned,
    LearnUnknown,
    Unpinned,
    InvalidRank,
    BodyTooLarge,
    BodyMalformed,
    KeyTooLong,
    ClusterHeaderStripped,
    Evictions,
    CasRetries,
    CasExhausted,
    Assigned,
    Moved,
    Room,
    RankCooldown,
    NoUsableRank,
    UntrustedRank,
    BucketUndecodable,
}

impl Counter {
    pub const ALL: [Counter; 22] = [
        Counter::Explicit,
        Counter::AffinityHit,
        Counter::AffinityMiss,
        Counter::NoKey,
        Counter::Learned,
        Counter::LearnUnknown,
        Counter::Unpinned,
        Counter::InvalidRank,
        Counter::BodyTooLarge,
        Counter::BodyMalformed,
        Counter::KeyTooLong,
        Counter::ClusterHeaderStripped,
        Counter::Evictions,
        Counter::CasRetries,
        Counter::CasExhausted,
        Counter::Assigned,
        Counter::Moved,
        Counter::Room,
        Counter::RankCooldown,
        Counter::NoUsableRank,
        Counter::UntrustedRank,
        Counter::BucketUndecodable,
    ];

    /// The metric name as defined with the host.
    pub fn name(self) -> &'static str {
        match self {
            Counter::Explicit => "dp_affinity.explicit",
            Counter::AffinityHit => "dp_affinity.affinity_hit",
            Counter::AffinityMiss => "dp_affinity.affinity_miss",
            Counter::NoKey => "dp_affinity.no_key",
            Counter::Learned => "dp_affinity.learned",
            Counter::LearnUnknown => "dp_affinity.learn_unknown",
            Counter::Unpinned => "dp_affinity.unpinned",
            Counter::InvalidRank => "dp_affinity.invalid_rank",
            Counter::BodyTooLarge => "dp_affinity.body_too_large",
            Counter::BodyMalformed => "dp_affinity.body_malformed",
            Counter::KeyTooLong => "dp_affinity.key_too_long",
            Counter::ClusterHeaderStripped => "dp_affinity.cluster_header_stripped",
            Counter::Evictions => "dp_affinity.evictions",
            Counter::CasRetries => "dp_affinity.cas_retries",
            Counter::CasExhausted => "dp_affinity.cas_exhausted",
            Counter::Assigned => "dp_affinity.assigned",
            Counter::Moved => "dp_affinity.moved",
            Counter::Room => "dp_affinity.bootstrap_room",
            Counter::RankCooldown => "dp_affinity.rank_cooldown",
            Counter::NoUsableRank => "dp_affinity.no_usable_rank",
            Counter::UntrustedRank => "dp_affinity.untrusted_rank",
            Counter::BucketUndecodable => "dp_affinity.bucket_undecodable",
        }
    }

    /// Position in `ALL`, used as an index into the host's id array.
    pub fn index(self) -> usize {
        self as usize
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_are_unique_and_indexes_match() {
        for (i, c) in Counter::ALL.iter().enumerate() {
            assert_eq!(c.index(), i);
            assert!(c.name().starts_with("dp_affinity."));
        }
        let mut names: Vec<_> = Counter::ALL.iter().map(|c| c.name()).collect();
        names.sort();
        names.dedup();
        assert_eq!(names.len(), Counter::ALL.len());
    }
}
