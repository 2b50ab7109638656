//! The `ReconcilePolicy` API (`wasmctrl.dev/v1alpha1`, cluster-scoped): which plugin decides
//! for which parent kind, which child kinds it may produce, what it may read, and under which
//! limits. The host turns each policy into one running controller.
//!
//! The schema rejects what it can (CEL where OpenAPI cannot say it), so a user learns about a
//! malformed policy from `kubectl apply`, not from the host's logs.

pub mod admission;
pub mod conversion;
pub mod namespaced;
pub mod permissions;
pub mod placement;
mod rollout;
mod verify;

pub use rollout::{
    ReplayConfigMap, ReplayGate, ReplayResult, RolloutSpec, RolloutStage, RolloutStatus,
    RolloutTransition,
};
pub use verify::{KeysConfigMap, KeysFrom, Signer, SignerIdentity, VerifySpec};

use k8s_openapi::apimachinery::pkg::apis::meta::v1::{Condition, LabelSelector};
use kube::{CustomResource, KubeSchema};
use serde::{Deserialize, Serialize};

/// The annotation whose every new value starts a rolled-back rollout over from its first
/// stage (`wasmctrl rollout retry` sets it).
pub const RETRY_ROLLOUT_ANNOTATION: &str = "wasmctrl.dev/retry-rollout";

/// The annotation that lets the deletions the prune guard holds proceed, set to the token
/// `status.pruneGuard.confirm` shows (`wasmctrl prune confirm` sets it).
pub const CONFIRM_PRUNE_ANNOTATION: &str = "wasmctrl.dev/confirm-prune";

/// Binds a reconcile plugin to a parent kind.
#[derive(CustomResource, KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[kube(
    group = "wasmctrl.dev",
    version = "v1alpha1",
    kind = "ReconcilePolicy",
    plural = "reconcilepolicies",
    shortname = "rp",
    status = "ReconcilePolicyStatus",
    printcolumn = r#"{"name":"Parent","type":"string","jsonPath":".spec.parent.kind"}"#,
    printcolumn = r#"{"name":"Plugin","type":"string","jsonPath":".status.activeDigestShort"}"#,
    printcolumn = r#"{"name":"Ready","type":"string","jsonPath":".status.conditions[?(@.type==\"Ready\")].status"}"#,
    printcolumn = r#"{"name":"Age","type":"date","jsonPath":".metadata.creationTimestamp"}"#
)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!has(self.conversion) || self.conversion.versions.exists(v, self.parent.apiVersion.endsWith('/' + v))").message("spec.conversion.versions lists the parent's own version (the version of spec.parent.apiVersion)"))]
pub struct ReconcilePolicySpec {
    /// The parent kind whose objects this policy reconciles.
    pub parent: ParentRef,
    /// The kinds the plugin may create. The host watches exactly these and refuses anything
    /// else a plugin returns.
    #[serde(default)]
    #[schemars(length(max = 64))]
    #[x_kube(validation = Rule::new("self.all(c, self.exists_one(d, d.apiVersion == c.apiVersion && d.kind == c.kind))").message("each child kind may be listed once"))]
    pub children: Vec<KindRef>,
    /// The plugin and its configuration.
    pub plugin: PluginSpec,
    /// Read-only objects the plugin receives, from the parent's namespace.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub related: Vec<RelatedSpec>,
    /// Sandbox limits for each call; unset fields take the host's defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub limits: Option<PolicyLimits>,
    /// Reconcile every parent at least this often, even if nothing changed (default 300).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub resync_period_seconds: Option<u32>,
    /// How many parents of this policy may be reconciled at once (default 4).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 1000))]
    pub max_concurrent_reconciles: Option<u32>,
    /// Hold a finalizer on each parent and call the plugin with `finalizing: true` on delete;
    /// the finalizer is removed once the plugin reports `finalized`.
    #[serde(default)]
    pub finalize: bool,
    /// How long a child that others depend on may wait, while being deleted, for them to be
    /// gone before the host reports the teardown as blocked (default 300). It keeps waiting:
    /// a blocked teardown is reported, never skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub teardown_timeout_seconds: Option<u32>,
    /// The identity the host acts as for this policy: every watch, read and write the policy
    /// causes goes through a client that impersonates this ServiceAccount, so the policy can
    /// do exactly what RBAC grants the account. Unset: the host acts as itself, which a host
    /// run with `--require-policy-identity` refuses (`IdentityRequired`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub service_account: Option<ServiceAccountRef>,
    /// Guards against mass deletion by a bad change: how many children a new plugin or a new
    /// generation of this policy may prune before the host holds further deletions for an
    /// admin to confirm. Unset fields take the defaults.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub safety: Option<SafetySpec>,
    /// Fields whose values must never leave the host in an explain record, a recorded case or
    /// a saved case: dot-separated paths (`spec.apiKey`, `data.token`, `status.adminPassword`)
    /// replaced by `<redacted>` wherever they occur in the parent, its children and the
    /// related objects (and, for `status.` paths, in the status written). Secret values are
    /// always redacted; this is for what the policy knows to be sensitive elsewhere.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    #[schemars(
        length(max = 64),
        inner(
            regex(pattern = r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$"),
            length(max = 256)
        )
    )]
    pub redact_fields: Vec<String>,
    /// Webhooks the plugin serves for the parent kind: validating and defaulting its writes
    /// before the API server stores them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admission: Option<admission::AdmissionSpec>,
    /// The API versions of the parent kind the plugin converts between, served as its
    /// CustomResourceDefinition's conversion webhook.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversion: Option<conversion::ConversionSpec>,
}

/// The prune guard's settings. Deletions count against two budgets of
/// `max(pruneFloor, maxPruneFraction × children)`: one per change (a new plugin, config,
/// candidate or generation, a restart or a takeover; a rollout's stages are one change),
/// taken of the children of the parents reconciled since the change, while it rolls out; and
/// one per `pruneWindowSeconds`, taken of every parent's children. A deletion past either is
/// held (`Ready=False`, `PruneHeld`) until an admin sets the `wasmctrl.dev/confirm-prune`
/// annotation to the value `status.pruneGuard.confirm` names (which lets exactly the held
/// deletions proceed, once), or the change is rolled back.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct SafetySpec {
    /// The share (0 to 1) of the children of the parents reconciled since a change that the
    /// change may prune before further deletions are held (default 0.2). 1 never holds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0.0, max = 1.0))]
    pub max_prune_fraction: Option<f64>,
    /// Deletions a change may always make, whatever the share (default 5), so small policies
    /// and ordinary deletions are never held.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub prune_floor: Option<u32>,
    /// The period of the budget over time, in seconds (default 600): in any such period at
    /// most `max(pruneFloor, maxPruneFraction × children)` are deleted, however the
    /// deletions come (a plugin that turns on its children long after a change, parents'
    /// specs shrinking together). 0 turns this budget off.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0, max = 86400))]
    pub prune_window_seconds: Option<u32>,
}

/// A ServiceAccount, by namespace and name.
#[derive(
    KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord,
)]
#[serde(rename_all = "camelCase")]
pub struct ServiceAccountRef {
    /// The ServiceAccount's namespace.
    #[schemars(length(min = 1, max = 63))]
    pub namespace: String,
    /// The ServiceAccount's name.
    #[schemars(length(min = 1, max = 253))]
    pub name: String,
}

impl ServiceAccountRef {
    /// The user name the API server knows the account by.
    pub fn user_name(&self) -> String {
        format!("system:serviceaccount:{}:{}", self.namespace, self.name)
    }
}

impl std::fmt::Display for ServiceAccountRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// The parent kind, and the namespace whose parents the policy reconciles.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "camelCase")]
pub struct ParentRef {
    /// e.g. `example.com/v1`.
    #[schemars(length(min = 1, max = 317))]
    pub api_version: String,
    /// e.g. `MyApp`.
    #[schemars(length(min = 1, max = 63))]
    pub kind: String,
    /// Reconcile only the parents in this namespace (default: every namespace the host
    /// watches). One parent kind belongs to one policy: a second policy for the same group and
    /// kind (under any version) is refused (`ParentKindTaken`) unless the two name different
    /// namespaces.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(length(min = 1, max = 63))]
    pub namespace: Option<String>,
}

impl ParentRef {
    /// The kind alone.
    pub fn kind_ref(&self) -> KindRef {
        KindRef {
            api_version: self.api_version.clone(),
            kind: self.kind.clone(),
        }
    }
}

/// A kind, by `apiVersion` and `kind`. Resolved through discovery, never by guessing plurals.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "camelCase")]
pub struct KindRef {
    /// e.g. `apps/v1`, or `v1` for the core group.
    #[schemars(length(min = 1, max = 317))]
    pub api_version: String,
    /// e.g. `Deployment`.
    #[schemars(length(min = 1, max = 63))]
    pub kind: String,
}

/// Where the plugin comes from, and how it is configured.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(has(self.source.http) || has(self.source.configMap) || (has(self.source.oci) && !self.source.oci.reference.contains('@sha256:'))) || has(self.digest)").message("a plugin fetched over http, from a registry or from a ConfigMap needs a digest (from a registry, a reference by @sha256: does too)"))]
#[x_kube(validation = Rule::new("!has(self.rollout) || (has(self.candidate) && !has(self.candidate.canary))").message("a rollout rolls out the candidate and picks its canary parents itself: set candidate, without candidate.canary"))]
pub struct PluginSpec {
    /// The component's source.
    pub source: PluginSource,
    /// The `sha256:` digest the component must have; checked before it is compiled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^sha256:[0-9a-f]{64}$"))]
    pub digest: Option<String>,
    /// Passed to the plugin as its config (any JSON object).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_object")]
    pub config: Option<serde_json::Value>,
    /// A second plugin to try before making it the active one. Without `canary` it runs in
    /// shadow: evaluated for every parent beside the active plugin, nothing applied, the
    /// differences counted in the policy status. With `canary`, it serves the parents the
    /// selector matches. Promote it by moving it to the active fields.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candidate: Option<CandidateSpec>,
    /// Roll the candidate out by itself: shadow, canary shares, every parent, each stage
    /// gated on what the candidate did so far; rolled back by the host when a gate fails.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutSpec>,
    /// The signatures this plugin and the candidate must carry, checked after each fetch and
    /// before the compile, and again whenever the host serves a digest it already holds.
    /// The host's own requirement (`--plugin-verify`), if it has one, applies besides it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub verify: Option<VerifySpec>,
}

/// The candidate plugin.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(has(self.source.http) || has(self.source.configMap) || (has(self.source.oci) && !self.source.oci.reference.contains('@sha256:'))) || has(self.digest)").message("a plugin fetched over http, from a registry or from a ConfigMap needs a digest (from a registry, a reference by @sha256: does too)"))]
pub struct CandidateSpec {
    /// The component's source.
    pub source: PluginSource,
    /// The `sha256:` digest the component must have.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(regex(pattern = r"^sha256:[0-9a-f]{64}$"))]
    pub digest: Option<String>,
    /// The candidate's config; the active plugin's config when unset.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(schema_with = "any_object")]
    pub config: Option<serde_json::Value>,
    /// Serve the matching parents with the candidate (the rest keep the active plugin).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<CanarySpec>,
}

/// Which parents a canary candidate serves.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct CanarySpec {
    /// Parents whose labels match.
    pub selector: LabelSelector,
}

/// Exactly one source.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("[has(self.file), has(self.configMap), has(self.http), has(self.oci)].filter(x, x).size() == 1").message("set exactly one plugin source: file, configMap, http or oci"))]
pub struct PluginSource {
    /// A component on the host's filesystem.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub file: Option<FileSource>,
    /// A component stored in a ConfigMap's `binaryData`. The `digest` is mandatory with this
    /// source, so whoever may edit the ConfigMap cannot swap the plugin.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub config_map: Option<ConfigMapSource>,
    /// A component served over HTTP(S). The `digest` is mandatory with this source.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub http: Option<HttpSource>,
    /// A component in an OCI registry, as a Wasm artifact (a layer of media type
    /// `application/wasm`). It must be pinned: by the `digest` of the component, or by a
    /// reference by digest (`REGISTRY/REPOSITORY@sha256:…`, the manifest's), or both;
    /// `wasmctrl plugin push` prints both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub oci: Option<OciSource>,
}

impl std::fmt::Display for PluginSource {
    /// Where the plugin is read from, as a message names it: `file plugins/x.wasm`,
    /// `ConfigMap ns/name key k`, `http https://…`, `oci REGISTRY/REPOSITORY:TAG`.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if let Some(file) = &self.file {
            write!(f, "file {}", file.path)?;
        }
        if let Some(map) = &self.config_map {
            write!(
                f,
                "ConfigMap {}/{} key {}",
                map.namespace, map.name, map.key
            )?;
        }
        if let Some(http) = &self.http {
            write!(f, "http {}", http.url)?;
        }
        if let Some(oci) = &self.oci {
            write!(f, "oci {}", oci.reference)?;
        }
        Ok(())
    }
}

/// A Wasm artifact in an OCI registry.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct OciSource {
    /// `registry/repository:tag`, or `registry/repository@sha256:…` to pin the manifest (it
    /// is checked on every pull).
    #[schemars(length(min = 1))]
    pub reference: String,
    /// Talk plain HTTP to the registry (a registry on loopback or inside the cluster network).
    #[serde(default)]
    pub insecure: bool,
    /// A Secret with credentials for this registry, in the host's credentials namespace: a
    /// `kubernetes.io/dockerconfigjson` Secret with an entry for the registry, or `token`
    /// (or `username` and `password`) with the registry in its `wasmctrl.dev/registry-hosts`
    /// annotation. Credentials go to no other host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretRef>,
}

impl OciSource {
    /// Whether the reference pins a manifest by digest (`…@sha256:…`), so the registry
    /// cannot hand out other bytes under it.
    pub fn pins_manifest(&self) -> bool {
        self.reference
            .parse::<oci_client::Reference>()
            .is_ok_and(|reference| reference.digest().is_some())
    }
}

/// A component at an HTTP(S) URL.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct HttpSource {
    /// `https://…` (or `http://…`).
    #[schemars(regex(pattern = r"^https?://"))]
    pub url: String,
    /// A Secret with credentials for the URL's host, in the host's credentials namespace:
    /// `token` (sent as a bearer token) or `username` and `password` (basic auth), with the
    /// host in its `wasmctrl.dev/registry-hosts` annotation, or a
    /// `kubernetes.io/dockerconfigjson` Secret with an entry for the host. Credentials go to
    /// no other host.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_ref: Option<SecretRef>,
}

/// A Secret, by namespace and name.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct SecretRef {
    /// The Secret's namespace.
    #[schemars(length(min = 1))]
    pub namespace: String,
    /// The Secret's name.
    #[schemars(length(min = 1))]
    pub name: String,
}

/// A component file readable by the host.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct FileSource {
    /// Path on the host; a relative path is resolved against the host's working directory.
    /// It must lie (symlinks followed) in one of the host's plugin directories
    /// (`--plugin-dir`).
    #[schemars(length(min = 1))]
    pub path: String,
}

/// A component in a ConfigMap's `binaryData`.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ConfigMapSource {
    /// The ConfigMap's namespace.
    #[schemars(length(min = 1))]
    pub namespace: String,
    /// The ConfigMap's name.
    #[schemars(length(min = 1))]
    pub name: String,
    /// The `binaryData` key holding the component.
    #[schemars(length(min = 1))]
    pub key: String,
}

/// A kind of read-only object the plugin receives: the objects a label selector matches, or
/// the objects a field of the parent names.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
#[x_kube(validation = Rule::new("!(has(self.selector) && has(self.nameFrom))").message("choose related objects by selector or by nameFrom, not both"))]
pub struct RelatedSpec {
    /// e.g. `v1`.
    #[schemars(length(min = 1))]
    pub api_version: String,
    /// e.g. `ConfigMap`.
    #[schemars(length(min = 1))]
    pub kind: String,
    /// Narrows the objects sent; all of the kind in the parent's namespace when unset (and
    /// `nameFrom` is unset too).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<LabelSelector>,
    /// Send only the object the parent names in this field (a dot-separated path such as
    /// `spec.databaseSecret`; the field holds a name, or a list of names), from the parent's
    /// namespace. The host watches the kind's metadata only and reads the named objects
    /// themselves, so no other object of the kind is held or sent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(
        regex(pattern = r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$"),
        length(max = 256)
    )]
    pub name_from: Option<String>,
    /// Redact every value of these objects (all but `apiVersion`, `kind` and `metadata`) in
    /// explain records and cases, keeping the keys, as Secret values always are: for kinds
    /// that carry credentials without being Secrets.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub redact: bool,
}

/// Per-call sandbox limits.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PolicyLimits {
    /// Wall-clock deadline per call, in milliseconds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 60000))]
    pub timeout_ms: Option<u32>,
    /// Memory cap, in MiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1, max = 4096))]
    pub memory_mib: Option<u32>,
    /// Cap on the total size of a response, in KiB.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 1))]
    pub max_output_kib: Option<u32>,
    /// Cap on the number of children one call may return.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 0))]
    pub max_children: Option<u32>,
}

/// What the host reports about a policy.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ReconcilePolicyStatus {
    /// The generation of the spec the host last acted on.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub observed_generation: Option<i64>,
    /// `Ready` and `PluginLoaded`, with reasons and messages.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub conditions: Vec<Condition>,
    /// The digest of the plugin serving this policy.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_digest: Option<String>,
    /// Its first 12 hex digits, for `kubectl get`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_digest_short: Option<String>,
    /// When the active plugin started serving.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub active_since: Option<k8s_openapi::apimachinery::pkg::apis::meta::v1::Time>,
    /// Who signed the active plugin, when its policy (or the host) requires signatures.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub active_signers: Vec<Signer>,
    /// What the candidate plugin would do differently, when there is one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub candidate: Option<CandidateStatus>,
    /// How the candidate's rollout stands, when the policy has one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rollout: Option<RolloutStatus>,
    /// Parents whose last reconcile succeeded.
    #[serde(default)]
    pub parents_reconciled: u64,
    /// Parents whose last reconcile failed.
    #[serde(default)]
    pub parents_failing: u64,
    /// Parents whose last successful reconcile was decided by the active plugin. After a
    /// swap, the rollout is complete when this equals `parentsReconciled` (parents carry no
    /// record of the plugin, so a swap to a plugin that decides the same writes nothing).
    #[serde(default)]
    pub parents_on_active_digest: u64,
    /// With hosts sharing the parents in shards (`wasmctrl run --shards`): each shard's
    /// holder and its parents, which the counts above sum. A shard whose holder has not
    /// counted them yet (just taken, or held by none) has no counts and adds nothing.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub shards: Vec<ShardStatus>,
    /// The child kinds the running controller manages (`spec.children` when it started).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub child_kinds: Vec<KindRef>,
    /// The parent kind (and namespace) this policy holds, written before its controller
    /// starts. While it matches `spec.parent` (by group and kind, whatever the version), this
    /// policy keeps the kind: another policy created or edited onto it is refused
    /// (`ParentKindTaken`), even an older one. Cleared when this policy is refused the kind.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub claimed_parent: Option<ParentRef>,
    /// Kinds removed from `spec.children` whose existing children the host kept: they are no
    /// longer watched, corrected or pruned (garbage collection still removes them with their
    /// parent). The `ChildrenManaged` condition says how many there are.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub unmanaged_child_kinds: Vec<KindRef>,
    /// Where parents may carry this policy's finalizer: each parent kind (and namespace) it
    /// finalized in, recorded before the first parent there got the finalizer and dropped
    /// once they were all released. A policy moved to another parent kind or namespace, one
    /// that stops finalizing, and one deleted release every scope listed here, so no parent
    /// (nor its namespace) is left Terminating for ever. The host writes it with a field
    /// manager of its own (`wasmctrl-finalizers`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub finalized_scopes: Vec<FinalizedScope>,
    /// The prune guard's window, while one is open: after a change, until every parent has
    /// been reconciled once under it (see `spec.safety`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub prune_guard: Option<PruneGuardStatus>,
    /// The webhooks served for the policy's parent kind (`spec.admission`), and since when;
    /// the `WebhooksServed` condition says why one asked for is not.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub webhooks: Vec<admission::ServedWebhook>,
    /// The parent CRD's conversion the hosts serve (`spec.conversion`), or still serve until
    /// no stored object needs it; the `ConversionServed` condition says why it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub conversion: Option<conversion::ConversionStatus>,
}

/// One shard of a sharded policy's parents, in its status.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Default)]
#[serde(rename_all = "camelCase")]
pub struct ShardStatus {
    /// The shard's number: its parents are those whose uid hashes into its range.
    pub shard: u32,
    /// The replica holding the shard, as its Lease says; none while it is free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub holder: Option<String>,
    /// Of the shard's parents, those whose last reconcile succeeded.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parents_reconciled: Option<u64>,
    /// Of the shard's parents, those whose last reconcile failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub parents_failing: Option<u64>,
}

/// How the prune guard stands in its current window.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct PruneGuardStatus {
    /// `Watching` (deletions counted), `Held` (deletions stopped until confirmed) or
    /// `Confirmed` (an admin let them proceed).
    pub state: String,
    /// What opened the window (a swap, a new generation, a start or a takeover).
    pub since: String,
    /// The `wasmctrl.dev/confirm-prune` annotation value that lets the deletions held now
    /// proceed: it is used once (the guard then shows a new one), and no other window's
    /// value confirms this one.
    pub confirm: String,
    /// Children deleted under this change.
    #[serde(default)]
    pub deleted: u64,
    /// Deletions this change allows without a confirmation.
    #[serde(default)]
    pub allowed: u64,
    /// The children of the parents reconciled so far under this change: what its share is
    /// taken of.
    #[serde(default)]
    pub children_seen: u64,
    /// Children deleted within the last `pruneWindowSeconds`.
    #[serde(default)]
    pub recently_deleted: u64,
    /// Deletions allowed per `pruneWindowSeconds`, of every parent's children.
    #[serde(default)]
    pub recently_allowed: u64,
    /// Deletions held.
    #[serde(default)]
    pub held_deletions: u64,
    /// The parents whose deletions are held.
    #[serde(default)]
    pub held_parents: u64,
    /// A few held deletions, `namespace/parent → Kind name`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub examples: Vec<String>,
}

/// Parents that may carry a policy's finalizer: those of one kind, in one namespace or all.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Eq, Hash)]
#[serde(rename_all = "camelCase")]
pub struct FinalizedScope {
    /// The parents' `apiVersion`, as the host resolved it.
    pub api_version: String,
    /// The parents' kind.
    pub kind: String,
    /// The namespace the policy was confined to; none for every namespace (and for a
    /// cluster-scoped kind).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub namespace: Option<String>,
}

/// The candidate plugin's standing.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq, Default)]
#[serde(rename_all = "camelCase")]
pub struct CandidateStatus {
    /// The candidate's digest.
    pub digest: String,
    /// Who signed the candidate, when signatures are required.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub signers: Vec<Signer>,
    /// Parents the candidate serves as a canary.
    #[serde(default)]
    pub canary_parents: u64,
    /// Parents the candidate was evaluated for in shadow (since it was loaded).
    #[serde(default)]
    pub evaluated: u64,
    /// Of those, parents whose desired children or status would change.
    #[serde(default)]
    pub would_change: u64,
    /// Parents the candidate would fail on.
    #[serde(default)]
    pub would_fail: u64,
    /// Parents the candidate would leave exactly as they are.
    #[serde(default)]
    pub unchanged: u64,
    /// A few of the differences, by parent.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub examples: Vec<ShadowExample>,
    /// How the candidate's webhook answers compare with the active plugin's, on the same
    /// writes (since it was loaded), when the policy serves webhooks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub webhooks: Option<admission::ShadowWebhooks>,
}

/// One parent the candidate would treat differently.
#[derive(KubeSchema, Serialize, Deserialize, Clone, Debug, PartialEq)]
#[serde(rename_all = "camelCase")]
pub struct ShadowExample {
    /// `namespace/name`.
    pub parent: String,
    /// `WouldChange` or `WouldFail`.
    pub verdict: String,
    /// What would change (`+`/`-`/`~` per child, and the first differing field), or the error.
    pub detail: String,
}

/// An object with any fields: the plugin config is the plugin's business. Nullable, because
/// server-side apply turns an empty object into `null`.
fn any_object(_: &mut schemars::SchemaGenerator) -> schemars::Schema {
    schemars::json_schema!({
        "type": "object",
        "nullable": true,
        "x-kubernetes-preserve-unknown-fields": true,
    })
}
