//! Harness for the end-to-end tests: real mock ranks, a real Envoy loading the
//! compiled filter, a tiny HTTP/1.1 client and an admin `/stats` reader.
//!
//! Every integration test crate (`e2e.rs`, `harness.rs`) includes this module and
//! uses a different subset of it, so unused items are expected per crate.
#![allow(dead_code)]

pub mod clients;
pub mod counters;
pub mod envoy;
pub mod fnv;
pub mod h2;
pub mod http;
pub mod mock;
pub mod paths;
pub mod requests;
pub mod stack;
pub mod tempdir;
