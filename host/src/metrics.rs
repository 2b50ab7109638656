//! The host's Prometheus metrics, named as controller-runtime names them where they mean the
//! same thing, so dashboards and alerts written for Go operators work unchanged.
//!
//! One [`Metrics`] per host, shared by every policy controller; each series is labelled with
//! the policy (`controller`). Encoding is the OpenMetrics text format that Prometheus scrapes.

use std::collections::{HashMap, HashSet};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::{Family, MetricConstructor};
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};

/// How a reconcile ended, as controller-runtime's `result` label spells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReconcileResult {
    /// Succeeded; next run on a change or at the policy's resync.
    Success,
    /// Succeeded and asked to run again after a delay.
    RequeueAfter,
    /// Failed.
    Error,
}

impl ReconcileResult {
    fn as_str(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::RequeueAfter => "requeue_after",
            Self::Error => "error",
        }
    }
}

/// The results of rollout transitions, as `wasmctrl_rollout_transitions` labels them.
pub const ROLLOUT_RESULTS: [&str; 4] = ["started", "advanced", "completed", "rolled_back"];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    controller: String,
    result: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WebhookLabels {
    policy: String,
    webhook: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WebhookResultLabels {
    policy: String,
    webhook: &'static str,
    result: &'static str,
}

/// How a webhook request ends, as `wasmctrl_webhook_requests_total` labels it: the plugin
/// allowed, denied or patched the write; it failed, and the failure policy refused
/// (`failed_closed`) or admitted (`failed_open`) it; the replica served no such policy
/// (`unserved`); the body was no AdmissionReview (`malformed`). A conversion's objects were
/// all `converted`, or one `failed` (and the review with it).
pub const WEBHOOK_RESULTS: [&str; 9] = [
    "allowed",
    "denied",
    "patched",
    "failed_closed",
    "failed_open",
    "unserved",
    "malformed",
    "converted",
    "failed",
];

/// The webhooks a policy serves, as metrics label them.
pub const WEBHOOKS: [&str; 3] = ["validate", "default", "convert"];

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ControllerLabels {
    controller: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CacheLabels {
    controller: String,
    /// `parents` or `children`.
    cache: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResourceLabels {
    resource: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct QueueLabels {
    name: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct LeaseLabels {
    name: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ShardSetLabels {
    set: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    controller: String,
    outcome: &'static str,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PluginResultLabels {
    controller: String,
    result: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct DigestLabels {
    controller: String,
    digest: String,
}

#[derive(Debug, Clone, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ChildLabels {
    controller: String,
    kind: String,
    operation: &'static str,
}

/// What the host did with one desired or observed child.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ChildOperation {
    /// Created or changed.
    Applied,
    /// Already as desired: nothing written.
    Unchanged,
    /// No longer desired: deleted.
    Pruned,
    /// Desired, but held back until what it depends on is ready.
    Waiting,
}

impl ChildOperation {
    fn as_str(self) -> &'static str {
        match self {
            Self::Applied => "applied",
            Self::Unchanged => "unchanged",
            Self::Pruned => "pruned",
            Self::Waiting => "waiting",
        }
    }
}

/// Buckets for reconcile and plugin call durations, in seconds: from 100 µs (a warm plugin
/// call) to a minute (a reconcile stuck behind retries).
fn duration_buckets() -> impl Iterator<Item = f64> {
    exponential_buckets(0.0001, 2.5, 14)
}

/// Every metric the host exports.
pub struct Metrics {
    registry: Registry,
    reconciles: Family<ResultLabels, Counter>,
    reconcile_errors: Family<ControllerLabels, Counter>,
    reconcile_time: Family<ControllerLabels, Histogram>,
    active_workers: Family<ControllerLabels, Gauge>,
    queue_depth: Family<QueueLabels, Gauge>,
    queue_adds: Family<QueueLabels, Counter>,
    queue_retries: Family<QueueLabels, Counter>,
    leader: Family<LeaseLabels, Gauge>,
    shards_held: Family<ShardSetLabels, Gauge>,
    plugin_calls: Family<OutcomeLabels, Counter>,
    plugin_call_time: Family<ControllerLabels, Histogram>,
    plugin_loads: Family<PluginResultLabels, Counter>,
    plugin_swaps: Family<PluginResultLabels, Counter>,
    loads_waiting: Gauge,
    active_plugin: Family<DigestLabels, Gauge>,
    child_operations: Family<ChildLabels, Counter>,
    events_dropped: Family<ControllerLabels, Counter>,
    reconciles_unchanged: Family<ControllerLabels, Counter>,
    reconciles_awaiting_creates: Family<ControllerLabels, Counter>,
    calls_to_converge: Family<ControllerLabels, Histogram>,
    prune_held: Family<ControllerLabels, Gauge>,
    rollout_stage: Family<ControllerLabels, Gauge>,
    rollout_transitions: Family<ResultLabels, Counter>,
    related_cache: Family<ControllerLabels, Gauge>,
    related_watches: Family<ResourceLabels, Gauge>,
    cached_objects: Family<CacheLabels, Gauge>,
    controller_restarts: Family<ControllerLabels, Counter>,
    webhook_requests: Family<WebhookResultLabels, Counter>,
    webhook_time: Family<WebhookLabels, Histogram>,
    explain_bytes: Gauge,
    explain_records: Gauge,
    pool_warm_memories: Gauge,
    pool_resident_bytes: Gauge,
    call_memory_budget_bytes: Gauge,
    call_memory_reserved_bytes: Gauge,
    /// The engine whose instance pool and call memory the four gauges above describe, read
    /// at each scrape.
    engine: std::sync::OnceLock<crate::plugin::PluginEngine>,
    /// The digest behind each policy's `wasmctrl_plugin_active_info` series, to remove it
    /// when another takes over.
    active_digests: Mutex<HashMap<String, String>>,
    /// Per policy, the labels of its series beyond the policy's name that are not known in
    /// advance, to remove every series of a deleted policy.
    free_labels: Mutex<HashMap<String, FreeLabels>>,
}

/// The label values a policy's series used that are not from a fixed list.
#[derive(Debug, Default)]
struct FreeLabels {
    load_results: HashSet<String>,
    swap_results: HashSet<String>,
    /// Plugin call outcomes missing from [`PLUGIN_OUTCOMES`].
    outcomes: HashSet<&'static str>,
    child_kinds: HashSet<String>,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

/// A histogram family with the host's duration buckets.
fn histograms<L>() -> Family<L, Histogram>
where
    L: Clone + std::hash::Hash + Eq,
{
    Family::new_with_constructor(|| Histogram::new(duration_buckets()))
}

impl Metrics {
    /// A fresh registry holding the host's metrics, all at zero.
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let metrics = Self {
            reconciles: Family::default(),
            reconcile_errors: Family::default(),
            reconcile_time: histograms(),
            active_workers: Family::default(),
            queue_depth: Family::default(),
            queue_adds: Family::default(),
            queue_retries: Family::default(),
            leader: Family::default(),
            shards_held: Family::default(),
            plugin_calls: Family::default(),
            plugin_call_time: histograms(),
            plugin_loads: Family::default(),
            plugin_swaps: Family::default(),
            loads_waiting: Gauge::default(),
            active_plugin: Family::default(),
            child_operations: Family::default(),
            events_dropped: Family::default(),
            reconciles_unchanged: Family::default(),
            reconciles_awaiting_creates: Family::default(),
            calls_to_converge: Family::new_with_constructor(|| {
                Histogram::new([1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 16.0])
            }),
            prune_held: Family::default(),
            rollout_stage: Family::default(),
            rollout_transitions: Family::default(),
            related_cache: Family::default(),
            related_watches: Family::default(),
            cached_objects: Family::default(),
            controller_restarts: Family::default(),
            webhook_requests: Family::default(),
            webhook_time: histograms(),
            explain_bytes: Gauge::default(),
            explain_records: Gauge::default(),
            pool_warm_memories: Gauge::default(),
            pool_resident_bytes: Gauge::default(),
            call_memory_budget_bytes: Gauge::default(),
            call_memory_reserved_bytes: Gauge::default(),
            engine: std::sync::OnceLock::new(),
            active_digests: Mutex::default(),
            free_labels: Mutex::default(),
            registry: Registry::default(),
        };
        metrics.register_controller_runtime(&mut registry);
        metrics.register_host_own(&mut registry);
        metrics.register_reconciles(&mut registry);
        metrics.register_caches(&mut registry);
        Self {
            registry,
            ..metrics
        }
    }

    /// controller-runtime's names, so dashboards and alerts for Go operators work as they are.
    fn register_controller_runtime(&self, registry: &mut Registry) {
        let metrics = self;
        registry.register(
            "controller_runtime_reconcile",
            "Total number of reconciliations per controller",
            metrics.reconciles.clone(),
        );
        registry.register(
            "controller_runtime_reconcile_errors",
            "Total number of reconciliation errors per controller",
            metrics.reconcile_errors.clone(),
        );
        registry.register_with_unit(
            "controller_runtime_reconcile_time",
            "Length of time per reconciliation per controller",
            Unit::Seconds,
            metrics.reconcile_time.clone(),
        );
        registry.register(
            "controller_runtime_active_workers",
            "Number of currently used workers per controller",
            metrics.active_workers.clone(),
        );
        registry.register(
            "workqueue_depth",
            "Parents waiting for a reconcile after a watch event, a swap or a takeover (timed requeues not included)",
            metrics.queue_depth.clone(),
        );
        registry.register(
            "workqueue_adds",
            "Total number of reconciles asked for by watch events, swaps and takeovers",
            metrics.queue_adds.clone(),
        );
        registry.register(
            "workqueue_retries",
            "Total number of retries after a failed reconcile",
            metrics.queue_retries.clone(),
        );
        registry.register(
            "leader_election_master_status",
            "Whether this replica leads (1) or stands by (0), per Lease",
            metrics.leader.clone(),
        );
        registry.register(
            "wasmctrl_shards_held",
            "How many shards of the set this replica holds (and reconciles the parents of)",
            metrics.shards_held.clone(),
        );
    }

    /// The host's own: plugins, children, events.
    fn register_host_own(&self, registry: &mut Registry) {
        let metrics = self;
        registry.register(
            "wasmctrl_plugin_calls",
            "Plugin calls per policy and outcome (ok, reported_error, trap, timeout, out_of_memory, invalid_output, sandbox_error)",
            metrics.plugin_calls.clone(),
        );
        registry.register_with_unit(
            "wasmctrl_plugin_call_duration",
            "Length of one plugin call, waiting for a call slot included",
            Unit::Seconds,
            metrics.plugin_call_time.clone(),
        );
        registry.register(
            "wasmctrl_plugin_loads",
            "Plugin loads per policy and result (ok, or the reason it failed)",
            metrics.plugin_loads.clone(),
        );
        registry.register(
            "wasmctrl_plugin_swaps",
            "Hot swaps per policy and result (swapped, rolled_back, refused)",
            metrics.plugin_swaps.clone(),
        );
        registry.register(
            "wasmctrl_plugin_loads_waiting",
            "Plugin loads (fetch and compile) waiting for one of the --max-concurrent-loads slots",
            metrics.loads_waiting.clone(),
        );
        registry.register(
            "wasmctrl_plugin_active_info",
            "The digest of the plugin serving each policy (value 1)",
            metrics.active_plugin.clone(),
        );
        registry.register(
            "wasmctrl_child_operations",
            "Children per policy, kind and operation: applied, unchanged (no write), pruned",
            metrics.child_operations.clone(),
        );
        registry.register(
            "wasmctrl_plugin_events_dropped",
            "Events a plugin asked for that the host did not record (over the per-reconcile or per-parent cap)",
            metrics.events_dropped.clone(),
        );
        registry.register(
            "wasmctrl_prune_held",
            "Child deletions the prune guard holds per policy, until an admin confirms the change or rolls it back",
            metrics.prune_held.clone(),
        );
        registry.register(
            "wasmctrl_rollout_stage",
            "The share of parents (0 to 100) a rollout has its candidate serve; -1 once rolled back",
            metrics.rollout_stage.clone(),
        );
        registry.register(
            "wasmctrl_rollout_transitions",
            "Rollout transitions per policy and result: started, advanced, completed, rolled_back",
            metrics.rollout_transitions.clone(),
        );
        registry.register(
            "wasmctrl_controller_restarts",
            "Restarts of a policy's controller after it panicked",
            metrics.controller_restarts.clone(),
        );
        registry.register_with_unit(
            "wasmctrl_explain_records",
            "Memory held by the reconcile records `wasmctrl explain` reads (bounded by --explain-memory-mib)",
            Unit::Bytes,
            metrics.explain_bytes.clone(),
        );
        registry.register(
            "wasmctrl_explain_records",
            "Reconcile records held for `wasmctrl explain`",
            metrics.explain_records.clone(),
        );
        registry.register(
            "wasmctrl_webhook_requests",
            "Webhook requests per policy, webhook (validate, default, convert) and result (allowed, denied, patched, failed_closed, failed_open, unserved, malformed; converted, failed)",
            metrics.webhook_requests.clone(),
        );
        registry.register_with_unit(
            "wasmctrl_webhook_duration",
            "Length of one webhook request as the host answers it, the plugin's call included",
            Unit::Seconds,
            metrics.webhook_time.clone(),
        );
        metrics.register_engine(registry);
    }

    /// How reconciles spent their plugin calls: those they made none, and what converging
    /// took.
    fn register_reconciles(&self, registry: &mut Registry) {
        let metrics = self;
        registry.register(
            "wasmctrl_reconciles_unchanged",
            "Reconciles that found nothing but the host's own writes changed since the plugin last decided, and neither called the plugin nor wrote",
            metrics.reconciles_unchanged.clone(),
        );
        registry.register(
            "wasmctrl_reconciles_awaiting_creates",
            "Reconciles that found someone else's change while children the last decision created were still on their way, and left the plugin to be asked once they arrive",
            metrics.reconciles_awaiting_creates.clone(),
        );
        registry.register(
            "wasmctrl_plugin_calls_to_converge",
            "Plugin calls a parent took to settle (a reconcile that writes, deletes and holds back no child) after a change, from the reconcile that first did not",
            metrics.calls_to_converge.clone(),
        );
    }

    /// What the policies' caches hold, and the watches of related kinds they share.
    fn register_caches(&self, registry: &mut Registry) {
        let metrics = self;
        registry.register_with_unit(
            "wasmctrl_related_cache",
            "Memory held by the related objects read by name per policy (at most 16 MiB per related kind)",
            Unit::Bytes,
            metrics.related_cache.clone(),
        );
        registry.register(
            "wasmctrl_cached_objects",
            "Objects a policy's caches hold, by cache: its parents, and its children of every kind. A sharded host that watches per shard holds those of its shards only",
            metrics.cached_objects.clone(),
        );
        registry.register(
            "wasmctrl_related_watches",
            "Watches of related objects the host holds open, by resource: one per identity, scope and selector, however many policies read them",
            metrics.related_watches.clone(),
        );
    }

    /// What the plugin engine reports: its instance pool and the memory of calls in flight.
    fn register_engine(&self, registry: &mut Registry) {
        let metrics = self;
        registry.register(
            "wasmctrl_plugin_pool_warm_memories",
            "Plugin memory slots not in use that keep a previous call's pages resident",
            metrics.pool_warm_memories.clone(),
        );
        registry.register_with_unit(
            "wasmctrl_plugin_pool_resident",
            "Memory the plugin instance pool keeps resident in slots not in use",
            Unit::Bytes,
            metrics.pool_resident_bytes.clone(),
        );
        registry.register_with_unit(
            "wasmctrl_plugin_call_memory_budget",
            "The memory the plugin calls in flight may reserve together (--plugin-memory-budget-mib)",
            Unit::Bytes,
            metrics.call_memory_budget_bytes.clone(),
        );
        registry.register_with_unit(
            "wasmctrl_plugin_call_memory_reserved",
            "The memory the plugin calls in flight reserve now: the sum of their memory limits",
            Unit::Bytes,
            metrics.call_memory_reserved_bytes.clone(),
        );
    }

    fn controller(policy: &str) -> ControllerLabels {
        ControllerLabels {
            controller: policy.to_owned(),
        }
    }

    fn queue(policy: &str) -> QueueLabels {
        QueueLabels {
            name: policy.to_owned(),
        }
    }

    /// Whether this replica holds the Lease `name`.
    pub fn set_leader(&self, name: &str, leading: bool) {
        self.leader
            .get_or_create(&LeaseLabels {
                name: name.to_owned(),
            })
            .set(i64::from(leading));
    }

    /// This replica holds `held` shards of the shard set `set`.
    pub fn set_shards_held(&self, set: &str, held: usize) {
        self.shards_held
            .get_or_create(&ShardSetLabels {
                set: set.to_owned(),
            })
            .set(i64::try_from(held).unwrap_or(i64::MAX));
    }

    /// A plugin load for `policy` ended with `result` (`ok` or the failure's reason).
    pub fn plugin_loaded(&self, policy: &str, result: &str) {
        self.free_labels(policy, |free| {
            free.load_results.insert(result.to_owned());
        });
        self.plugin_loads
            .get_or_create(&PluginResultLabels {
                controller: policy.to_owned(),
                result: result.to_owned(),
            })
            .inc();
    }

    /// A hot swap for `policy` ended with `result`.
    pub fn plugin_swapped(&self, policy: &str, result: &str) {
        self.free_labels(policy, |free| {
            free.swap_results.insert(result.to_owned());
        });
        self.plugin_swaps
            .get_or_create(&PluginResultLabels {
                controller: policy.to_owned(),
                result: result.to_owned(),
            })
            .inc();
    }

    /// `digest` serves `policy` now (and whatever served it before no longer does);
    /// `None` when the policy stopped.
    pub fn set_active_plugin(&self, policy: &str, digest: Option<&str>) {
        let previous = {
            let mut active = crate::lock(&self.active_digests);
            match digest {
                Some(digest) => active.insert(policy.to_owned(), digest.to_owned()),
                None => active.remove(policy),
            }
        };
        if let Some(previous) = previous.filter(|p| Some(p.as_str()) != digest) {
            self.active_plugin.remove(&DigestLabels {
                controller: policy.to_owned(),
                digest: previous,
            });
        }
        if let Some(digest) = digest {
            self.active_plugin
                .get_or_create(&DigestLabels {
                    controller: policy.to_owned(),
                    digest: digest.to_owned(),
                })
                .set(1);
        }
    }

    /// The controller of `policy` panicked and is restarted.
    pub fn controller_restarted(&self, policy: &str) {
        self.controller_restarts
            .get_or_create(&Self::controller(policy))
            .inc();
    }

    /// Record label values of `policy`'s series that [`Self::forget_policy`] could not know.
    fn free_labels(&self, policy: &str, record: impl FnOnce(&mut FreeLabels)) {
        record(
            crate::lock(&self.free_labels)
                .entry(policy.to_owned())
                .or_default(),
        );
    }

    /// Remove every series of `policy`, which was deleted. Called once nothing of its
    /// controller runs any more: a [`PolicyMetrics`] still in use would count into series no
    /// longer exported.
    pub fn forget_policy(&self, policy: &str) {
        let free = crate::lock(&self.free_labels)
            .remove(policy)
            .unwrap_or_default();
        let controller = Self::controller(policy);
        let queue = Self::queue(policy);
        for result in [
            ReconcileResult::Success,
            ReconcileResult::RequeueAfter,
            ReconcileResult::Error,
        ] {
            self.reconciles.remove(&ResultLabels {
                controller: policy.to_owned(),
                result: result.as_str(),
            });
        }
        self.reconcile_errors.remove(&controller);
        self.reconcile_time.remove(&controller);
        self.active_workers.remove(&controller);
        self.plugin_call_time.remove(&controller);
        self.events_dropped.remove(&controller);
        self.reconciles_unchanged.remove(&controller);
        self.reconciles_awaiting_creates.remove(&controller);
        self.calls_to_converge.remove(&controller);
        self.prune_held.remove(&controller);
        self.rollout_stage.remove(&controller);
        for result in ROLLOUT_RESULTS {
            self.rollout_transitions.remove(&ResultLabels {
                controller: policy.to_owned(),
                result,
            });
        }
        self.related_cache.remove(&controller);
        for cache in CACHES {
            self.cached_objects.remove(&CacheLabels {
                controller: policy.to_owned(),
                cache,
            });
        }
        self.controller_restarts.remove(&controller);
        self.queue_depth.remove(&queue);
        self.queue_adds.remove(&queue);
        self.queue_retries.remove(&queue);
        for outcome in PLUGIN_OUTCOMES.into_iter().chain(free.outcomes) {
            self.plugin_calls.remove(&OutcomeLabels {
                controller: policy.to_owned(),
                outcome,
            });
        }
        for (family, results) in [
            (&self.plugin_loads, free.load_results),
            (&self.plugin_swaps, free.swap_results),
        ] {
            for result in results {
                family.remove(&PluginResultLabels {
                    controller: policy.to_owned(),
                    result,
                });
            }
        }
        for kind in free.child_kinds {
            for operation in [
                ChildOperation::Applied,
                ChildOperation::Unchanged,
                ChildOperation::Pruned,
            ] {
                self.child_operations.remove(&ChildLabels {
                    controller: policy.to_owned(),
                    kind: kind.clone(),
                    operation: operation.as_str(),
                });
            }
        }
        for webhook in WEBHOOKS {
            for result in WEBHOOK_RESULTS {
                self.webhook_requests.remove(&WebhookResultLabels {
                    policy: policy.to_owned(),
                    webhook,
                    result,
                });
            }
            self.webhook_time.remove(&WebhookLabels {
                policy: policy.to_owned(),
                webhook,
            });
        }
        self.set_active_plugin(policy, None);
    }

    /// One webhook request of `policy` ended with `result` (one of [`WEBHOOK_RESULTS`]),
    /// after `took` when the plugin was asked.
    pub fn webhook_request(
        &self,
        policy: &str,
        webhook: &'static str,
        result: &'static str,
        took: Option<std::time::Duration>,
    ) {
        self.webhook_requests
            .get_or_create(&WebhookResultLabels {
                policy: policy.to_owned(),
                webhook,
                result,
            })
            .inc();
        if let Some(took) = took {
            self.webhook_time
                .get_or_create(&WebhookLabels {
                    policy: policy.to_owned(),
                    webhook,
                })
                .observe(took.as_secs_f64());
        }
    }

    /// One more (`1`) or one fewer (`-1`) plugin load waits for a slot.
    pub fn load_waiting(&self, delta: i64) {
        self.loads_waiting.inc_by(delta);
    }

    /// The count of the host's watches of related `resource` (`v1/configmaps`), to raise
    /// while one runs.
    pub fn related_watches(&self, resource: &str) -> Gauge {
        self.related_watches
            .get_or_create(&ResourceLabels {
                resource: resource.to_owned(),
            })
            .clone()
    }

    /// What the explain store holds now (set when metrics are scraped).
    pub fn set_explain_store(&self, bytes: usize, records: usize) {
        self.explain_bytes
            .set(i64::try_from(bytes).unwrap_or(i64::MAX));
        self.explain_records
            .set(i64::try_from(records).unwrap_or(i64::MAX));
    }

    /// How many reconciles of `policy` ended with `result` so far.
    pub fn reconcile_count(&self, policy: &str, result: ReconcileResult) -> u64 {
        self.reconciles
            .get_or_create(&ResultLabels {
                controller: policy.to_owned(),
                result: result.as_str(),
            })
            .get()
    }

    /// Report on `engine`'s instance pool from now on (the first engine given wins).
    pub fn observe_plugin_pool(&self, engine: crate::plugin::PluginEngine) {
        let _ = self.engine.set(engine);
    }

    /// The metrics in the OpenMetrics text format.
    pub fn encode(&self) -> String {
        if let Some(engine) = self.engine.get() {
            let pool = engine.pool_usage();
            self.pool_warm_memories.set(i64::from(pool.warm_memories));
            self.pool_resident_bytes
                .set(i64::try_from(pool.resident_bytes).unwrap_or(i64::MAX));
            let memory = engine.call_memory();
            let bytes = |value: u64| i64::try_from(value).unwrap_or(i64::MAX);
            self.call_memory_budget_bytes
                .set(bytes(memory.budget_bytes));
            self.call_memory_reserved_bytes
                .set(bytes(memory.reserved_bytes));
        }
        let mut text = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut text, &self.registry);
        text
    }
}

/// One policy's series, each resolved at its first use and kept: a reconcile counts and
/// times itself without building a label set or looking a series up again. A series appears
/// when it is first counted, as it did before there was a handle (a clean run shows no
/// error series). Clones share the series.
#[derive(Clone)]
pub struct PolicyMetrics {
    policy: Arc<str>,
    metrics: Arc<Metrics>,
    series: Arc<PolicySeries>,
}

/// The series behind a [`PolicyMetrics`], created at first use.
#[derive(Default)]
struct PolicySeries {
    success: OnceLock<Counter>,
    requeue_after: OnceLock<Counter>,
    error: OnceLock<Counter>,
    errors: OnceLock<Counter>,
    reconcile_time: OnceLock<Histogram>,
    workers: OnceLock<Gauge>,
    queue_depth: OnceLock<Gauge>,
    queue_adds: OnceLock<Counter>,
    retries: OnceLock<Counter>,
    plugin_call_time: OnceLock<Histogram>,
    events_dropped: OnceLock<Counter>,
    unchanged: OnceLock<Counter>,
    awaiting_creates: OnceLock<Counter>,
    calls_to_converge: OnceLock<Histogram>,
    related_cache: OnceLock<Gauge>,
    /// Per call outcome, in the order of [`PLUGIN_OUTCOMES`].
    plugin_calls: [OnceLock<Counter>; PLUGIN_OUTCOMES.len()],
    /// Per child kind, per operation (in [`ChildOperation`]'s order).
    children: Mutex<HashMap<String, [Option<Counter>; 4]>>,
}

/// The caches `wasmctrl_cached_objects` counts.
const CACHES: [&str; 2] = ["parents", "children"];

/// Every outcome a plugin call can have, as `wasmctrl_plugin_calls_total` labels it.
const PLUGIN_OUTCOMES: [&str; 7] = [
    "ok",
    "reported_error",
    "trap",
    "timeout",
    "out_of_memory",
    "invalid_output",
    "sandbox_error",
];

impl Metrics {
    /// The handle on `policy`'s series.
    pub fn policy(self: &Arc<Self>, policy: &str) -> PolicyMetrics {
        PolicyMetrics {
            policy: policy.into(),
            metrics: self.clone(),
            series: Arc::default(),
        }
    }
}

/// `cell`'s series: taken from `family` under `labels` the first time, then kept.
fn first_use<'a, L, M, C>(
    cell: &'a OnceLock<M>,
    family: &Family<L, M, C>,
    labels: impl FnOnce() -> L,
) -> &'a M
where
    L: Clone + std::hash::Hash + Eq,
    M: Clone,
    C: MetricConstructor<M>,
{
    cell.get_or_init(|| family.get_or_create(&labels()).clone())
}

impl PolicyMetrics {
    fn controller(&self) -> ControllerLabels {
        Metrics::controller(&self.policy)
    }

    fn queue(&self) -> QueueLabels {
        Metrics::queue(&self.policy)
    }

    /// Count one finished reconcile and how long it took.
    pub fn reconciled(&self, result: ReconcileResult, took: Duration) {
        let (metrics, series) = (&self.metrics, &self.series);
        let cell = match result {
            ReconcileResult::Success => &series.success,
            ReconcileResult::RequeueAfter => &series.requeue_after,
            ReconcileResult::Error => &series.error,
        };
        first_use(cell, &metrics.reconciles, || ResultLabels {
            controller: self.policy.to_string(),
            result: result.as_str(),
        })
        .inc();
        if result == ReconcileResult::Error {
            first_use(&series.errors, &metrics.reconcile_errors, || {
                self.controller()
            })
            .inc();
        }
        first_use(&series.reconcile_time, &metrics.reconcile_time, || {
            self.controller()
        })
        .observe(took.as_secs_f64());
    }

    /// A reconcile started (`+1`) or ended (`-1`).
    pub fn worker(&self, delta: i64) {
        first_use(&self.series.workers, &self.metrics.active_workers, || {
            self.controller()
        })
        .inc_by(delta);
    }

    /// `added` parents were asked to reconcile; `depth` wait now.
    pub fn queued(&self, added: u64, depth: usize) {
        first_use(&self.series.queue_adds, &self.metrics.queue_adds, || {
            self.queue()
        })
        .inc_by(added);
        self.set_queue_depth(depth);
    }

    /// `depth` parents wait for a reconcile.
    pub fn set_queue_depth(&self, depth: usize) {
        first_use(&self.series.queue_depth, &self.metrics.queue_depth, || {
            self.queue()
        })
        .set(i64::try_from(depth).unwrap_or(i64::MAX));
    }

    /// A failed reconcile will be retried.
    pub fn retried(&self) {
        first_use(&self.series.retries, &self.metrics.queue_retries, || {
            self.queue()
        })
        .inc();
    }

    /// One plugin call ended with `outcome` after `took`.
    pub fn plugin_called(&self, outcome: &'static str, took: Duration) {
        let labels = || OutcomeLabels {
            controller: self.policy.to_string(),
            outcome,
        };
        match PLUGIN_OUTCOMES.iter().position(|o| *o == outcome) {
            Some(index) => {
                first_use(
                    &self.series.plugin_calls[index],
                    &self.metrics.plugin_calls,
                    labels,
                )
                .inc();
            }
            // An outcome this list does not know yet still counts.
            None => {
                self.metrics.free_labels(&self.policy, |free| {
                    free.outcomes.insert(outcome);
                });
                self.metrics.plugin_calls.get_or_create(&labels()).inc();
            }
        }
        first_use(
            &self.series.plugin_call_time,
            &self.metrics.plugin_call_time,
            || self.controller(),
        )
        .observe(took.as_secs_f64());
    }

    /// Count what the host did with `count` children of `kind`.
    pub fn children(&self, kind: &str, operation: ChildOperation, count: u64) {
        if count == 0 {
            return;
        }
        let mut children = crate::lock(&self.series.children);
        if !children.contains_key(kind) {
            children.insert(kind.to_owned(), Default::default());
            self.metrics.free_labels(&self.policy, |free| {
                free.child_kinds.insert(kind.to_owned());
            });
        }
        let Some(slots) = children.get_mut(kind) else {
            return;
        };
        let counter = slots[operation as usize].get_or_insert_with(|| {
            self.metrics
                .child_operations
                .get_or_create(&ChildLabels {
                    controller: self.policy.to_string(),
                    kind: kind.to_owned(),
                    operation: operation.as_str(),
                })
                .clone()
        });
        counter.inc_by(count);
    }

    /// A reconcile found someone else's change while the last decision's creates were still
    /// on their way, and left the plugin to be asked once they arrive.
    pub fn awaiting_creates(&self) {
        first_use(
            &self.series.awaiting_creates,
            &self.metrics.reconciles_awaiting_creates,
            || self.controller(),
        )
        .inc();
    }

    /// A parent settled after `calls` plugin calls since it last was.
    pub fn converged(&self, calls: u32) {
        first_use(
            &self.series.calls_to_converge,
            &self.metrics.calls_to_converge,
            || self.controller(),
        )
        .observe(f64::from(calls));
    }

    /// A reconcile found nothing but the host's own writes changed since the plugin last
    /// decided, and asked it nothing.
    pub fn unchanged(&self) {
        first_use(
            &self.series.unchanged,
            &self.metrics.reconciles_unchanged,
            || self.controller(),
        )
        .inc();
    }

    /// Count plugin Events that were not recorded.
    pub fn events_dropped(&self, count: u64) {
        first_use(
            &self.series.events_dropped,
            &self.metrics.events_dropped,
            || self.controller(),
        )
        .inc_by(count);
    }

    /// The related objects a policy's kind read by name went from `before` to `after` bytes
    /// (each kind reports its own changes; the series is their sum).
    pub fn related_cache_changed(&self, before: usize, after: usize) {
        if before == after {
            return;
        }
        let delta = |bytes: usize| i64::try_from(bytes).unwrap_or(i64::MAX);
        first_use(
            &self.series.related_cache,
            &self.metrics.related_cache,
            || self.controller(),
        )
        .inc_by(delta(after) - delta(before));
    }

    /// How many parents and children the policy's caches hold now.
    pub fn set_cached(&self, parents: usize, children: usize) {
        for (cache, count) in CACHES.into_iter().zip([parents, children]) {
            self.metrics
                .cached_objects
                .get_or_create(&CacheLabels {
                    controller: self.policy.to_string(),
                    cache,
                })
                .set(i64::try_from(count).unwrap_or(i64::MAX));
        }
    }

    /// A hot swap ended with `result`.
    pub fn swapped(&self, result: &str) {
        self.metrics.plugin_swapped(&self.policy, result);
    }

    /// The share of parents the policy's rollout has its candidate serve (-1 once rolled
    /// back); `None` when the policy has no rollout.
    pub fn set_rollout_stage(&self, percent: Option<i64>) {
        let labels = self.controller();
        match percent {
            Some(percent) => {
                self.metrics
                    .rollout_stage
                    .get_or_create(&labels)
                    .set(percent);
            }
            None => {
                self.metrics.rollout_stage.remove(&labels);
            }
        }
    }

    /// A rollout made a transition ending in `result` (one of [`ROLLOUT_RESULTS`]).
    pub fn rollout_transition(&self, result: &'static str) {
        self.metrics
            .rollout_transitions
            .get_or_create(&ResultLabels {
                controller: self.policy.to_string(),
                result,
            })
            .inc();
    }

    /// `digest` serves the policy now; `None` when it stopped.
    pub fn set_active_plugin(&self, digest: Option<&str>) {
        self.metrics.set_active_plugin(&self.policy, digest);
    }

    /// The prune guard holds `held` deletions now. The series appears with the first hold,
    /// and stays (at 0 once released) until [`Self::forget_prune_held`].
    pub fn set_prune_held(&self, held: u64) {
        let labels = self.controller();
        if held == 0 && self.metrics.prune_held.get(&labels).is_none() {
            return;
        }
        self.metrics
            .prune_held
            .get_or_create(&labels)
            .set(i64::try_from(held).unwrap_or(i64::MAX));
    }

    /// The policy's controller stopped: its held deletions are no longer anyone's.
    pub fn forget_prune_held(&self) {
        self.metrics.prune_held.remove(&self.controller());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reconciles_are_counted_per_policy_and_result_with_errors_apart() {
        let metrics = Arc::new(Metrics::new());
        let took = Duration::from_millis(3);
        let (a, b) = (metrics.policy("a"), metrics.policy("b"));
        a.reconciled(ReconcileResult::Success, took);
        a.reconciled(ReconcileResult::Error, took);
        b.reconciled(ReconcileResult::RequeueAfter, took);
        assert_eq!(metrics.reconcile_count("a", ReconcileResult::Success), 1);
        assert_eq!(metrics.reconcile_count("a", ReconcileResult::Error), 1);
        assert_eq!(metrics.reconcile_count("b", ReconcileResult::Error), 0);
        let text = metrics.encode();
        for series in [
            r#"controller_runtime_reconcile_total{controller="a",result="success"} 1"#,
            r#"controller_runtime_reconcile_errors_total{controller="a"} 1"#,
            r#"controller_runtime_reconcile_time_seconds_count{controller="a"} 2"#,
            r#"controller_runtime_reconcile_time_seconds_bucket{le="0.00390625",controller="a"} 2"#,
        ] {
            assert!(text.contains(series), "{series} missing from\n{text}");
        }
    }

    #[test]
    fn only_the_serving_digest_is_reported_active() {
        let metrics = Metrics::new();
        metrics.set_active_plugin("p", Some("sha256:aa"));
        metrics.set_active_plugin("p", Some("sha256:bb"));
        metrics.set_active_plugin("q", Some("sha256:aa"));
        let text = metrics.encode();
        assert!(
            text.contains(r#"wasmctrl_plugin_active_info{controller="p",digest="sha256:bb"} 1"#)
        );
        assert!(
            !text.contains(r#"controller="p",digest="sha256:aa""#),
            "{text}"
        );
        assert!(
            text.contains(r#"wasmctrl_plugin_active_info{controller="q",digest="sha256:aa"} 1"#)
        );
        metrics.set_active_plugin("q", None);
        assert!(!metrics.encode().contains(r#"controller="q""#));
    }

    #[test]
    fn queue_workers_and_children_have_their_series() {
        let metrics = Arc::new(Metrics::new());
        let p = metrics.policy("p");
        p.queued(3, 3);
        p.set_queue_depth(2);
        p.retried();
        p.worker(1);
        p.children("ConfigMap", ChildOperation::Applied, 1);
        p.clone().children("ConfigMap", ChildOperation::Applied, 1);
        p.children("ConfigMap", ChildOperation::Unchanged, 0);
        p.plugin_called("ok", Duration::from_micros(40));
        // Two related kinds of one policy report into one series.
        p.related_cache_changed(0, 300);
        p.clone().related_cache_changed(0, 200);
        p.related_cache_changed(300, 100);
        assert!(
            !metrics
                .encode()
                .contains("controller_runtime_reconcile_errors_total{"),
            "a series appears at its first use, not with the handle"
        );
        let text = metrics.encode();
        for series in [
            r#"workqueue_adds_total{name="p"} 3"#,
            r#"workqueue_depth{name="p"} 2"#,
            r#"workqueue_retries_total{name="p"} 1"#,
            r#"controller_runtime_active_workers{controller="p"} 1"#,
            r#"wasmctrl_child_operations_total{controller="p",kind="ConfigMap",operation="applied"} 2"#,
            r#"wasmctrl_plugin_calls_total{controller="p",outcome="ok"} 1"#,
            r#"wasmctrl_plugin_call_duration_seconds_count{controller="p"} 1"#,
            r#"wasmctrl_related_cache_bytes{controller="p"} 300"#,
        ] {
            assert!(text.contains(series), "{series} missing from\n{text}");
        }
        assert!(
            !text.contains("operation=\"unchanged\""),
            "zero counts add no series"
        );
    }

    #[test]
    fn held_prunes_have_a_series_from_the_first_hold_until_the_controller_stops() {
        let metrics = Arc::new(Metrics::new());
        let p = metrics.policy("p");
        p.set_prune_held(0);
        assert!(
            !metrics.encode().contains("wasmctrl_prune_held{"),
            "no hold yet"
        );
        p.set_prune_held(600);
        assert!(
            metrics
                .encode()
                .contains(r#"wasmctrl_prune_held{controller="p"} 600"#)
        );
        p.set_prune_held(0);
        assert!(
            metrics
                .encode()
                .contains(r#"wasmctrl_prune_held{controller="p"} 0"#)
        );
        p.forget_prune_held();
        assert!(!metrics.encode().contains("wasmctrl_prune_held{"));
    }

    #[test]
    fn a_deleted_policys_series_are_all_removed_and_no_other() {
        let metrics = Arc::new(Metrics::new());
        for name in ["gone", "kept"] {
            let p = metrics.policy(name);
            p.reconciled(ReconcileResult::Success, Duration::from_millis(1));
            p.reconciled(ReconcileResult::Error, Duration::from_millis(1));
            p.reconciled(ReconcileResult::RequeueAfter, Duration::from_millis(1));
            p.worker(1);
            p.queued(2, 2);
            p.retried();
            p.plugin_called("ok", Duration::from_micros(40));
            p.plugin_called("a_new_outcome", Duration::from_micros(40));
            p.children("ConfigMap", ChildOperation::Applied, 1);
            p.children("Secret", ChildOperation::Pruned, 1);
            p.events_dropped(1);
            p.unchanged();
            p.set_prune_held(3);
            p.related_cache_changed(0, 100);
            p.set_active_plugin(Some("sha256:aa"));
            p.swapped("swapped");
            metrics.plugin_loaded(name, "ok");
            metrics.plugin_loaded(name, "DigestMismatch");
            metrics.controller_restarted(name);
        }
        let before = metrics.encode();
        assert!(before.contains(r#"controller="gone""#), "{before}");
        assert!(before.contains(r#"name="gone""#), "{before}");
        metrics.forget_policy("gone");
        let after = metrics.encode();
        assert!(!after.contains(r#""gone""#), "{after}");
        let kept = |text: &str| text.lines().filter(|l| l.contains(r#""kept""#)).count();
        assert_eq!(kept(&after), kept(&before), "{after}");
        // A policy created again under the name starts its series afresh.
        metrics
            .policy("gone")
            .reconciled(ReconcileResult::Success, Duration::from_millis(1));
        assert!(metrics.encode().contains(
            r#"controller_runtime_reconcile_total{controller="gone",result="success"} 1"#
        ));
    }

    #[test]
    fn the_plugin_pool_is_read_at_each_scrape() {
        use crate::plugin::{EngineOptions, Limits, PluginEngine, ReconcileRequest};
        let metrics = Metrics::new();
        let engine = PluginEngine::new(EngineOptions::default()).expect("engine");
        metrics.observe_plugin_pool(engine.clone());
        let value = |text: &str, series: &str| -> f64 {
            text.lines()
                .find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.parse().ok())
                .unwrap_or_else(|| panic!("{series} missing: {text}"))
        };
        let before = metrics.encode();
        assert_eq!(value(&before, "wasmctrl_plugin_pool_warm_memories"), 0.0);
        assert_eq!(value(&before, "wasmctrl_plugin_pool_resident_bytes"), 0.0);

        let plugin = engine
            .load(
                &wasmctrl_testenv::plugins::guest_bytes("misbehave_plugin"),
                None,
                Limits::default(),
            )
            .expect("load");
        plugin
            .reconcile_blocking(ReconcileRequest {
                parent: r#"{"metadata":{"name":"p"}}"#.to_owned(),
                ..ReconcileRequest::default()
            })
            .expect("call");
        // The call's memory slot is free again and keeps the pages the call touched.
        let after = metrics.encode();
        assert!(
            value(&after, "wasmctrl_plugin_pool_warm_memories") >= 1.0,
            "{after}"
        );
        assert!(
            value(&after, "wasmctrl_plugin_pool_resident_bytes") > 0.0,
            "{after}"
        );
    }
}
