//! A loaded plugin and its call path: a call waits for one of the engine's call slots, runs
//! on one of its call threads in a fresh sandbox under the plugin's limits and deadline, and
//! comes back as the plugin's validated answer or as the precise way it failed.

use std::sync::Arc;
use std::time::Duration;

use wasmtime::component::Instance;
use wasmtime::{Store, Trap};

use super::call::{self, JsonObject, ReconcileRequest, ReconcileResponse};
use super::call_slots::{CallSlots, Slot};
use super::call_threads::CallThreads;
use super::contract::{PluginIndices, PluginPre, wit_webhooks};
use super::digest::Digest;
use super::error::{CallError, LoadError};
use super::idle_lane;
use super::limits::Limits;
use super::sandbox::{MemoryCapExceeded, Sandbox};
use super::webhook::{self, AdmissionRequest, AdmissionVerdict, Defaulted, ServedWebhooks};

/// How often the engine's epoch clock ticks. Deadlines are enforced to within one tick. It
/// lives with the call path, which counts every call's deadline in ticks; the engine's clock
/// only keeps time by it.
pub(crate) const EPOCH_TICK: Duration = Duration::from_millis(5);

/// Facts about a loaded plugin, for status, logs and `wasmctrl plugin inspect`.
#[derive(Debug, Clone)]
pub struct PluginInfo {
    /// Content digest of the component bytes.
    pub digest: Digest,
    /// Size of the component in bytes (unknown when loaded by digest from the cache).
    pub size_bytes: Option<usize>,
    /// The `wasmctrl:plugin` contract version the plugin exports.
    pub contract_version: Option<String>,
    /// Names the component imports.
    pub imports: Vec<String>,
    /// Names the component exports.
    pub exports: Vec<String>,
    /// Time to compile, or to load the precompiled artifact.
    pub load_time: Duration,
    /// Whether the precompiled artifact came from the on-disk cache.
    pub from_cache: bool,
}

/// A loaded plugin, ready to be called. Clones share the compiled code.
#[derive(Clone)]
pub struct Plugin {
    inner: Arc<PluginInner>,
}

struct PluginInner {
    /// The pre-instantiated component; it also holds the wasmtime engine every call runs on.
    pre: PluginPre<Sandbox>,
    /// Where the reconciler's functions are in every instance.
    indices: PluginIndices,
    /// Where the webhook functions are, when the plugin exports them (contract 0.1.1).
    webhooks: Option<wit_webhooks::GuestIndices>,
    /// What the plugin's `served` answered, asked once at load.
    served: std::sync::OnceLock<ServedWebhooks>,
    /// The engine's call slots, shared with every plugin it loaded.
    call_slots: Arc<CallSlots>,
    /// The engine's call threads, shared with every plugin it loaded.
    call_threads: Arc<CallThreads>,
    limits: Limits,
    info: PluginInfo,
    /// `sha256:<short>` for log attribution.
    label: String,
}

/// A [`Plugin`] that is only reachable while something else still holds it.
#[derive(Clone)]
pub struct WeakPlugin(std::sync::Weak<PluginInner>);

impl WeakPlugin {
    /// The plugin, if it is still loaded.
    pub fn upgrade(&self) -> Option<Plugin> {
        self.0.upgrade().map(|inner| Plugin { inner })
    }
}

impl std::fmt::Debug for Plugin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Plugin")
            .field("digest", &self.inner.info.digest)
            .field("limits", &self.inner.limits)
            .finish_non_exhaustive()
    }
}

impl Plugin {
    /// A plugin the engine has checked and pre-instantiated, whose calls share the engine's
    /// call slots and threads. A plugin that exports webhooks is asked which it serves now,
    /// once: a plugin whose `served` fails is refused, rather than failing every webhook call
    /// later.
    pub(crate) fn new(
        pre: PluginPre<Sandbox>,
        webhooks: Option<wit_webhooks::GuestIndices>,
        call_slots: Arc<CallSlots>,
        call_threads: Arc<CallThreads>,
        limits: Limits,
        info: PluginInfo,
    ) -> Result<Self, LoadError> {
        let label = format!("sha256:{}", info.digest.short());
        let indices = PluginIndices::new(pre.instance_pre())
            .map_err(|e| LoadError::WrongWorld(format!("{e:#}")))?;
        let exports_webhooks = webhooks.is_some();
        let plugin = Self {
            inner: Arc::new(PluginInner {
                pre,
                indices,
                webhooks,
                served: std::sync::OnceLock::new(),
                call_slots,
                call_threads,
                limits,
                info,
                label,
            }),
        };
        let served = if exports_webhooks {
            let timeout = plugin.inner.limits.webhook_timeout;
            match plugin.attempt(Served, timeout).into_result() {
                Ok(served) => served,
                Err(CallError::PoolExhausted(message)) => return Err(LoadError::Sandbox(message)),
                Err(error) => {
                    return Err(LoadError::WrongWorld(format!(
                        "its `served` export failed: {error}"
                    )));
                }
            }
        } else {
            ServedWebhooks::default()
        };
        let _ = plugin.inner.served.set(served);
        Ok(plugin)
    }

    /// A handle that does not keep the plugin loaded: a registry of loaded plugins can share
    /// one while anything uses it without keeping it alive after.
    pub fn downgrade(&self) -> WeakPlugin {
        WeakPlugin(Arc::downgrade(&self.inner))
    }

    /// Whether both handles are the same loaded plugin (not merely the same digest).
    pub fn same_as(&self, other: &Plugin) -> bool {
        Arc::ptr_eq(&self.inner, &other.inner)
    }

    /// What was loaded.
    pub fn info(&self) -> &PluginInfo {
        &self.inner.info
    }

    /// The plugin's digest.
    pub fn digest(&self) -> &Digest {
        &self.inner.info.digest
    }

    /// The limits every call runs under.
    pub fn limits(&self) -> &Limits {
        &self.inner.limits
    }

    /// Reconcile one parent without blocking the async runtime.
    ///
    /// The call waits for one of the engine's call slots, then runs on one of the engine's
    /// call threads (at most one per slot in use; see `call_threads`), so nothing on the
    /// async runtime stalls behind a slow plugin and a burst of fast calls does not multiply
    /// threads. If the caller stops waiting, the call still runs to its end (at most its
    /// deadline) and keeps its slot until then.
    pub async fn reconcile(
        &self,
        request: ReconcileRequest,
    ) -> Result<ReconcileResponse, CallError> {
        self.reconcile_as("", request).await
    }

    /// [`Plugin::reconcile`] on behalf of `tenant` (a policy): the engine's call slots are
    /// shared fairly between tenants, so one tenant's slow or looping calls cannot starve
    /// another's. If the instance pool is momentarily exhausted (plugins with many core
    /// instances), the call waits for running calls to finish, up to its own timeout, rather
    /// than failing.
    pub async fn reconcile_as(
        &self,
        tenant: &str,
        request: ReconcileRequest,
    ) -> Result<ReconcileResponse, CallError> {
        self.call_as(tenant, Reconcile(request)).await
    }

    /// Whether the plugin exports the webhooks interface (contract 0.1.1 and later); which
    /// of them it serves is [`Plugin::served_webhooks`].
    pub fn exports_webhooks(&self) -> bool {
        self.inner.webhooks.is_some()
    }

    /// The webhooks the plugin serves: none for a plugin without the webhooks export, else
    /// what its `served` answered when it was loaded.
    pub fn served_webhooks(&self) -> ServedWebhooks {
        self.inner.served.get().copied().unwrap_or_default()
    }

    /// Ask the plugin's `validate` whether a write is allowed, on behalf of `tenant`.
    pub async fn validate(
        &self,
        tenant: &str,
        request: AdmissionRequest,
    ) -> Result<AdmissionVerdict, CallError> {
        self.require("validate", |s| s.validate)?;
        self.call_as(tenant, Validate(request)).await
    }

    /// [`Plugin::validate`] on the current thread.
    pub fn validate_blocking(
        &self,
        request: AdmissionRequest,
    ) -> Result<AdmissionVerdict, CallError> {
        self.require("validate", |s| s.validate)?;
        self.attempt_blocking(Validate(request))
    }

    /// Ask the plugin's `default` to fill in `request.object`, on behalf of `tenant`. The
    /// answer keeps the object's identity (checked).
    pub async fn apply_defaults(
        &self,
        tenant: &str,
        request: AdmissionRequest,
    ) -> Result<Defaulted, CallError> {
        self.require("default", |s| s.default)?;
        self.call_as(tenant, ApplyDefaults::new(request)?).await
    }

    /// [`Plugin::apply_defaults`] on the current thread.
    pub fn apply_defaults_blocking(
        &self,
        request: AdmissionRequest,
    ) -> Result<Defaulted, CallError> {
        self.require("default", |s| s.default)?;
        self.attempt_blocking(ApplyDefaults::new(request)?)
    }

    /// Ask the plugin's `convert` to rewrite `object` to `desired_api_version`, on behalf of
    /// `tenant`. The answer reaches that version and keeps what the API server requires
    /// (checked).
    pub async fn convert(
        &self,
        tenant: &str,
        object: JsonObject,
        desired_api_version: &str,
    ) -> Result<JsonObject, CallError> {
        self.require("convert", |s| s.convert)?;
        self.call_as(tenant, Convert::new(object, desired_api_version))
            .await
    }

    /// [`Plugin::convert`] on the current thread.
    pub fn convert_blocking(
        &self,
        object: JsonObject,
        desired_api_version: &str,
    ) -> Result<JsonObject, CallError> {
        self.require("convert", |s| s.convert)?;
        self.attempt_blocking(Convert::new(object, desired_api_version))
    }

    /// [`CallError::NotServed`] unless the plugin says it serves `name`.
    fn require(
        &self,
        name: &'static str,
        serves: fn(&ServedWebhooks) -> bool,
    ) -> Result<(), CallError> {
        if serves(&self.served_webhooks()) {
            Ok(())
        } else {
            Err(CallError::NotServed(name))
        }
    }

    /// One call of `call` on the current thread under its whole deadline.
    fn attempt_blocking<C: Call>(&self, call: C) -> Result<C::Output, CallError> {
        self.attempt(call, C::timeout(&self.inner.limits))
            .into_result()
    }

    /// Run `call` in one of the engine's call slots, shared fairly between tenants, waiting
    /// for the instance pool when it is momentarily full.
    ///
    /// A reconcile waits for a slot as long as its tenant's turn takes, and each attempt gets
    /// the whole timeout. A webhook call has one budget for all of it (the slot, the pool,
    /// the call), since a client's write waits on the answer: past it, it ends as
    /// [`CallError::DeadlineExceeded`]. Webhook calls neither earn nor clear a tenant's
    /// penalty, which is about its reconciles (a client's writes must not lift it), and never
    /// run at idle priority.
    async fn call_as<C: Call>(&self, tenant: &str, call: C) -> Result<C::Output, CallError> {
        let slots = &self.inner.call_slots;
        let timeout = C::timeout(&self.inner.limits);
        let started = std::time::Instant::now();
        let left = || timeout.saturating_sub(started.elapsed());
        let out_of_time = || CallError::DeadlineExceeded { timeout };
        let mut call = call;
        loop {
            let acquire = slots.acquire(tenant, self.inner.limits.memory_bytes);
            let slot = if C::WEBHOOK {
                tokio::time::timeout(left(), acquire)
                    .await
                    .map_err(|_| out_of_time())?
            } else {
                acquire.await
            }
            .map_err(|refused| CallError::Sandbox(refused.to_string()))?;
            let (idle, deadline) = if C::WEBHOOK {
                (false, left())
            } else {
                (slots.is_penalized(tenant), timeout)
            };
            if deadline.is_zero() {
                return Err(out_of_time());
            }
            let attempt = self.attempt_in_slot(call, slot, idle, deadline).await;
            if !C::WEBHOOK {
                match &attempt {
                    Attempt::Done(Err(CallError::DeadlineExceeded { .. })) => {
                        slots.penalize(tenant, PENALTY);
                    }
                    Attempt::Done(Ok(_)) => slots.forgive(tenant),
                    _ => {}
                }
            }
            match attempt {
                Attempt::PoolExhausted(returned, _) if started.elapsed() < timeout => {
                    // Capacity comes back when some call ends (this one's own slot, given
                    // back already, does not count: the wait starts after it).
                    let _ = tokio::time::timeout(EPOCH_TICK * 20, slots.released()).await;
                    call = returned;
                }
                Attempt::Done(Err(CallError::DeadlineExceeded { .. })) => {
                    return Err(out_of_time());
                }
                attempt => return attempt.into_result(),
            }
        }
    }

    /// One attempt on a call thread, holding `slot` until the call is over (also when the
    /// caller stops waiting); at idle priority on a thread of its own when `idle` (the
    /// tenant is penalized).
    async fn attempt_in_slot<C: Call>(
        &self,
        call: C,
        slot: Slot,
        idle: bool,
        deadline: Duration,
    ) -> Attempt<C> {
        let plugin = self.clone();
        let work = move || {
            let attempt = plugin.attempt(call, deadline);
            (attempt, slot)
        };
        let ran = if idle {
            idle_lane::run_at_idle_priority(work).await
        } else {
            self.inner.call_threads.run(work).await
        };
        match ran {
            // The slot goes back here, after the call thread is idle again.
            Some((attempt, _slot)) => attempt,
            None => Attempt::Done(Err(CallError::Sandbox(
                "the plugin call thread failed".into(),
            ))),
        }
    }

    /// Reconcile one parent on the current thread, in a fresh sandbox.
    ///
    /// Blocks for up to the plugin's timeout. From async code use [`Plugin::reconcile`]. The
    /// caller must not run more calls at once than the engine's `max_concurrent_calls`
    /// ([`Plugin::reconcile`] enforces that); past it, instantiation fails with
    /// [`CallError::PoolExhausted`].
    pub fn reconcile_blocking(
        &self,
        request: ReconcileRequest,
    ) -> Result<ReconcileResponse, CallError> {
        self.attempt_blocking(Reconcile(request))
    }

    /// Instantiate in a fresh store and call, trapping after `timeout`. When the instance
    /// pool has no room, the call comes back untouched, so the caller can wait and try again
    /// without copying it.
    fn attempt<C: Call>(&self, call: C, timeout: Duration) -> Attempt<C> {
        let inner = &*self.inner;
        let limits = &inner.limits;
        let mut store = Store::new(
            inner.pre.engine(),
            Sandbox::new(inner.label.clone(), limits.memory_bytes),
        );
        store.limiter(|sandbox| &mut sandbox.memory);
        // Bound what the host copies out of the guest, before it copies: without this, one
        // large string aliased by many list entries would cost its size once per entry.
        store.set_hostcall_fuel(copy_limit(limits));
        store.set_epoch_deadline(deadline_ticks(timeout));
        store.epoch_deadline_trap();

        let answer = match inner.pre.instance_pre().instantiate(&mut store) {
            Err(error)
                if error
                    .downcast_ref::<wasmtime::PoolConcurrencyLimitError>()
                    .is_some() =>
            {
                return Attempt::PoolExhausted(call, format!("{error:#}"));
            }
            Err(error) => Err(error),
            Ok(instance) => call.invoke(inner, &mut store, &instance),
        };
        store.data_mut().forward_stdio();
        let dropped = store.data().log.dropped();
        if dropped > 0 {
            tracing::warn!(plugin = %inner.label, dropped, "plugin log budget exhausted; messages dropped");
        }
        Attempt::Done(match answer {
            Ok(answer) => answer,
            Err(error) => Err(classify_failure(error, store.data_mut(), limits, timeout)),
        })
    }
}

/// One kind of call into a plugin: which export it calls with what, and how the answer is
/// checked. Every kind runs the same way (fresh sandbox, limits, deadline, call slots).
trait Call: Send + 'static {
    /// The checked answer.
    type Output: Send + 'static;

    /// A webhook call: a client's write waits on it (see [`Plugin::call_as`]).
    const WEBHOOK: bool = true;

    /// The deadline of one call of this kind.
    fn timeout(limits: &Limits) -> Duration {
        limits.webhook_timeout
    }

    /// Call the export in `instance`: a wasmtime error when the call itself failed (a trap,
    /// the deadline), else the answer as checked against the limits and the contract.
    fn invoke(
        self,
        plugin: &PluginInner,
        store: &mut Store<Sandbox>,
        instance: &Instance,
    ) -> wasmtime::Result<Result<Self::Output, CallError>>;
}

struct Reconcile(ReconcileRequest);

impl Call for Reconcile {
    type Output = ReconcileResponse;
    const WEBHOOK: bool = false;

    fn timeout(limits: &Limits) -> Duration {
        limits.timeout
    }

    fn invoke(
        self,
        plugin: &PluginInner,
        store: &mut Store<Sandbox>,
        instance: &Instance,
    ) -> wasmtime::Result<Result<ReconcileResponse, CallError>> {
        let bindings = plugin.indices.load(&mut *store, instance)?;
        let answer = bindings
            .wasmctrl_plugin_reconciler()
            .call_reconcile(&mut *store, &self.0.into())?;
        Ok(call::accept(answer, &plugin.limits))
    }
}

/// The webhook functions of `instance`, or why the plugin has none.
fn webhooks_of(
    plugin: &PluginInner,
    store: &mut Store<Sandbox>,
    instance: &Instance,
    name: &'static str,
) -> wasmtime::Result<Result<wit_webhooks::Guest, CallError>> {
    match &plugin.webhooks {
        Some(indices) => Ok(Ok(indices.load(&mut *store, instance)?)),
        None => Ok(Err(CallError::NotServed(name))),
    }
}

struct Served;

impl Call for Served {
    type Output = ServedWebhooks;

    fn invoke(
        self,
        plugin: &PluginInner,
        store: &mut Store<Sandbox>,
        instance: &Instance,
    ) -> wasmtime::Result<Result<ServedWebhooks, CallError>> {
        let hooks = match webhooks_of(plugin, store, instance, "served")? {
            Ok(hooks) => hooks,
            Err(error) => return Ok(Err(error)),
        };
        Ok(Ok(hooks.call_served(&mut *store)?.into()))
    }
}

struct Validate(AdmissionRequest);

impl Call for Validate {
    type Output = AdmissionVerdict;

    fn invoke(
        self,
        plugin: &PluginInner,
        store: &mut Store<Sandbox>,
        instance: &Instance,
    ) -> wasmtime::Result<Result<AdmissionVerdict, CallError>> {
        let hooks = match webhooks_of(plugin, store, instance, "validate")? {
            Ok(hooks) => hooks,
            Err(error) => return Ok(Err(error)),
        };
        let answer = hooks.call_validate(&mut *store, &self.0.into())?;
        Ok(webhook::accept_verdict(answer, &plugin.limits))
    }
}

/// A `default` call and the object it defaults, kept to check the answer against.
struct ApplyDefaults {
    request: AdmissionRequest,
    original: JsonObject,
}

impl ApplyDefaults {
    fn new(request: AdmissionRequest) -> Result<Self, CallError> {
        let original = request.object.clone().ok_or_else(|| {
            CallError::InvalidRequest("a default call needs the object being written".into())
        })?;
        Ok(Self { request, original })
    }
}

impl Call for ApplyDefaults {
    type Output = Defaulted;

    fn invoke(
        self,
        plugin: &PluginInner,
        store: &mut Store<Sandbox>,
        instance: &Instance,
    ) -> wasmtime::Result<Result<Defaulted, CallError>> {
        let hooks = match webhooks_of(plugin, store, instance, "default")? {
            Ok(hooks) => hooks,
            Err(error) => return Ok(Err(error)),
        };
        let answer = hooks.call_default(&mut *store, &self.request.into())?;
        Ok(webhook::accept_defaulted(
            answer,
            &self.original,
            &plugin.limits,
        ))
    }
}

/// A `convert` call and the object it converts, kept to check the answer against.
struct Convert {
    original: JsonObject,
    json: String,
    desired_api_version: String,
}

impl Convert {
    fn new(original: JsonObject, desired_api_version: &str) -> Self {
        Self {
            json: serde_json::Value::Object(original.clone()).to_string(),
            original,
            desired_api_version: desired_api_version.to_owned(),
        }
    }
}

impl Call for Convert {
    type Output = JsonObject;

    fn invoke(
        self,
        plugin: &PluginInner,
        store: &mut Store<Sandbox>,
        instance: &Instance,
    ) -> wasmtime::Result<Result<JsonObject, CallError>> {
        let hooks = match webhooks_of(plugin, store, instance, "convert")? {
            Ok(hooks) => hooks,
            Err(error) => return Ok(Err(error)),
        };
        let answer = hooks.call_convert(&mut *store, &self.json, &self.desired_api_version)?;
        Ok(webhook::accept_converted(
            answer,
            &self.original,
            &self.desired_api_version,
            &plugin.limits,
        ))
    }
}

/// How one try at a call ended.
enum Attempt<C: Call> {
    Done(Result<C::Output, CallError>),
    /// No room in the instance pool; the call, unused, and wasmtime's message.
    PoolExhausted(C, String),
}

impl<C: Call> Attempt<C> {
    fn into_result(self) -> Result<C::Output, CallError> {
        match self {
            Self::Done(result) => result,
            Self::PoolExhausted(_, message) => Err(CallError::PoolExhausted(message)),
        }
    }
}

/// How long a tenant whose call ran out of time stays penalized (one call at a time, at idle
/// priority), unless one of its calls finishes in time first.
const PENALTY: std::time::Duration = std::time::Duration::from_secs(30);

/// Bytes the host copies out of one call at most: the output limit, plus a quarter for the
/// answer's structure (list and record headers) and the plugin's log messages.
fn copy_limit(limits: &Limits) -> usize {
    limits
        .max_output_bytes
        .saturating_add(limits.max_output_bytes / 4)
        .saturating_add(64 << 10)
}

/// Ticks until the deadline: one more than the timeout needs, so the trap fires after the
/// timeout (within one tick), never before.
fn deadline_ticks(timeout: Duration) -> u64 {
    let tick = EPOCH_TICK.as_nanos();
    u64::try_from(timeout.as_nanos().div_ceil(tick)).unwrap_or(u64::MAX / 2) + 1
}

/// Turn a wasmtime failure into the precise [`CallError`].
fn classify_failure(
    error: wasmtime::Error,
    sandbox: &mut Sandbox,
    limits: &Limits,
    timeout: Duration,
) -> CallError {
    if let Some(cap) = error.downcast_ref::<MemoryCapExceeded>() {
        return CallError::MemoryExceeded {
            limit_bytes: cap.limit,
            requested_bytes: cap.requested,
        };
    }
    if let Some(Trap::Interrupt) = error.downcast_ref::<Trap>() {
        return CallError::DeadlineExceeded { timeout };
    }
    if let Some(exit) = error.downcast_ref::<wasmtime_wasi::I32Exit>() {
        return CallError::Trap {
            message: format!("plugin called exit({})", exit.0),
            plugin_said: sandbox.log.last_failure(),
        };
    }
    if let Some(trap) = error.downcast_ref::<Trap>() {
        return CallError::Trap {
            message: trap.to_string(),
            plugin_said: sandbox.log.last_failure(),
        };
    }
    // wasmtime's hostcall-fuel error is a private type; its message is the stable part.
    if error.chain().any(|cause| {
        cause
            .to_string()
            .starts_with("too much data is being copied")
    }) {
        return CallError::OutputCopyRefused {
            limit_bytes: copy_limit(limits),
        };
    }
    CallError::Trap {
        message: error.root_cause().to_string(),
        plugin_said: sandbox.log.last_failure(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deadline_fires_after_the_timeout_never_before() {
        let ticks = deadline_ticks(Duration::from_millis(100));
        let earliest = EPOCH_TICK * u32::try_from(ticks - 1).expect("small");
        assert!(earliest >= Duration::from_millis(100), "{earliest:?}");
        assert!(EPOCH_TICK * u32::try_from(ticks).expect("small") <= Duration::from_millis(110));
    }
}
