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
    RoomUnplaced,
    RankCooldown,
    NoUsableRank,
    UntrustedRank,
    BucketUndecodable,
    PrefixHit,
    PrefixMiss,
    PrefixSkippedFull,
    PrefixSpread,
    PrefixHitBlocks1To3,
    PrefixHitBlocks4To15,
    PrefixHitBlocks16To63,
    PrefixHitBlocks64Plus,
    PrefixRecorded,
    PrefixWithdrawn,
    PrefixForgotten,
    PrefixEvictions,
    PrefixReads,
    PrefixWrites,
    StatsFlushes,
    RankErrors,
    Unanswered,
    AnswerCut,
    TargetBodyRewritten,
    TargetBodyStripped,
    TargetBodyUnwritable,
    TargetHeaderStripped,
    Untargeted,
    HomeSecondWork,
    HomeSecondQueue,
    HomeFull,
    KeyOverruled,
}

impl Counter {
    pub const ALL: [Counter; 50] = [
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
        Counter::RoomUnplaced,
        Counter::RankCooldown,
        Counter::NoUsableRank,
        Counter::UntrustedRank,
        Counter::BucketUndecodable,
        Counter::PrefixHit,
        Counter::PrefixMiss,
        Counter::PrefixSkippedFull,
        Counter::PrefixSpread,
        Counter::PrefixHitBlocks1To3,
        Counter::PrefixHitBlocks4To15,
        Counter::PrefixHitBlocks16To63,
        Counter::PrefixHitBlocks64Plus,
        Counter::PrefixRecorded,
        Counter::PrefixWithdrawn,
        Counter::PrefixForgotten,
        Counter::PrefixEvictions,
        Counter::PrefixReads,
        Counter::PrefixWrites,
        Counter::StatsFlushes,
        Counter::RankErrors,
        Counter::Unanswered,
        Counter::AnswerCut,
        Counter::TargetBodyRewritten,
        Counter::TargetBodyStripped,
        Counter::TargetBodyUnwritable,
        Counter::TargetHeaderStripped,
        Counter::Untargeted,
        Counter::HomeSecondWork,
        Counter::HomeSecondQueue,
        Counter::HomeFull,
        Counter::KeyOverruled,
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
            Counter::RoomUnplaced => "dp_affinity.bootstrap_room_unplaced",
            Counter::RankCooldown => "dp_affinity.rank_cooldown",
            Counter::NoUsableRank => "dp_affinity.no_usable_rank",
            Counter::UntrustedRank => "dp_affinity.untrusted_rank",
            Counter::BucketUndecodable => "dp_affinity.bucket_undecodable",
            Counter::PrefixHit => "dp_affinity.prefix_hit",
            Counter::PrefixMiss => "dp_affinity.prefix_miss",
            Counter::PrefixSkippedFull => "dp_affinity.prefix_skipped_full",
            Counter::PrefixSpread => "dp_affinity.prefix_spread",
            Counter::PrefixHitBlocks1To3 => "dp_affinity.prefix_hit_blocks_1_3",
            Counter::PrefixHitBlocks4To15 => "dp_affinity.prefix_hit_blocks_4_15",
            Counter::PrefixHitBlocks16To63 => "dp_affinity.prefix_hit_blocks_16_63",
            Counter::PrefixHitBlocks64Plus => "dp_affinity.prefix_hit_blocks_64_plus",
            Counter::PrefixRecorded => "dp_affinity.prefix_recorded",
            Counter::PrefixWithdrawn => "dp_affinity.prefix_withdrawn",
            Counter::PrefixForgotten => "dp_affinity.prefix_forgotten",
            Counter::PrefixEvictions => "dp_affinity.prefix_evictions",
            Counter::PrefixReads => "dp_affinity.prefix_reads",
            Counter::PrefixWrites => "dp_affinity.prefix_writes",
            Counter::StatsFlushes => "dp_affinity.stats_flushes",
            Counter::RankErrors => "dp_affinity.rank_errors",
            Counter::Unanswered => "dp_affinity.unanswered",
            Counter::AnswerCut => "dp_affinity.answer_cut",
            Counter::TargetBodyRewritten => "dp_affinity.target_body_rewritten",
            Counter::TargetBodyStripped => "dp_affinity.target_body_stripped",
            Counter::TargetBodyUnwritable => "dp_affinity.target_body_unwritable",
            Counter::TargetHeaderStripped => "dp_affinity.target_header_stripped",
            Counter::Untargeted => "dp_affinity.untargeted",
            Counter::HomeSecondWork => "dp_affinity.home_second_work",
            Counter::HomeSecondQueue => "dp_affinity.home_second_queue",
            Counter::HomeFull => "dp_affinity.home_full",
            Counter::KeyOverruled => "dp_affinity.key_overruled",
        }
    }

    /// The bucket of a prefix hit's matched length, in blocks (a histogram in four counters:
    /// Envoy's wasm ABI has histograms, but four counters are cheaper to flush and to read).
    pub fn prefix_hit_blocks(blocks: usize) -> Counter {
        match blocks {
            0..=3 => Counter::PrefixHitBlocks1To3,
            4..=15 => Counter::PrefixHitBlocks4To15,
            16..=63 => Counter::PrefixHitBlocks16To63,
            _ => Counter::PrefixHitBlocks64Plus,
        }
    }

    /// Position in `ALL`, used as an index into the host's id array.
    pub fn index(self) -> usize {
        self as usize
    }
}

/// The gauge of requests in flight on `rank`, summed over this Envoy's workers.
pub fn rank_inflight_gauge(rank: u32) -> String {
    format!("dp_affinity.rank_inflight.{rank}")
}

/// The gauge that is 1 while `rank` is cooling down, else 0.
pub fn rank_cooling_gauge(rank: u32) -> String {
    format!("dp_affinity.rank_cooling_down.{rank}")
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

    #[test]
    fn prefix_hit_buckets() {
        for (blocks, name) in [
            (1, "prefix_hit_blocks_1_3"),
            (3, "prefix_hit_blocks_1_3"),
            (4, "prefix_hit_blocks_4_15"),
            (15, "prefix_hit_blocks_4_15"),
            (16, "prefix_hit_blocks_16_63"),
            (63, "prefix_hit_blocks_16_63"),
            (64, "prefix_hit_blocks_64_plus"),
            (4096, "prefix_hit_blocks_64_plus"),
        ] {
            assert_eq!(
                Counter::prefix_hit_blocks(blocks).name(),
                format!("dp_affinity.{name}")
            );
        }
    }
}
