//! Stand-in for the main crate's `telemetry` module in the network fuzz targets: the policy
//! gate counts into these metrics; without a recorder installed the counts go nowhere, so only
//! the names are needed (they match `src/telemetry/metrics.rs`).

pub mod metrics {
    pub const NET_FLOWS: &str = "tryboxi_network_flows_total";
    pub const NET_BYTES: &str = "tryboxi_network_bytes_total";
    pub const NET_DNS: &str = "tryboxi_network_dns_queries_total";
    pub const NET_EVENTS_SUPPRESSED: &str = "tryboxi_network_events_suppressed_total";
}
