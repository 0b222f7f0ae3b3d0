//! The configuration sections that modules below the configuration parser are built from: the
//! affinity table's geometry ([`TableConfig`], the prefix index's too) and the error a section's
//! checks report ([`ConfigError`]). Plain data that depends on nothing else in the crate, so the
//! modules that take a section never import `config` (the JSON reader and validator), and `config`
//! depends on this module, never the reverse.

use std::fmt;

#[derive(Debug, Clone)]
pub struct TableConfig {
    pub buckets: u32,
    pub ways: u32,
    pub ttl_seconds: u32,
    pub refresh_seconds: u32,
    pub cas_retries: u32,
    pub namespace: String,
}

/// A configuration error naming the offending field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConfigError {
    pub field: String,
    pub message: String,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "invalid plugin configuration: {}: {}",
            self.field, self.message
        )
    }
}

impl std::error::Error for ConfigError {}
