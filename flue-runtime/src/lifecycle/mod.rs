//! Standard Agents lifecycle hooks (the types of [`flue_core::lifecycle`], re-exported) and
//! how they run: which hooks run at a point (`HookSet`), the
//! chains that run them with the reference's error rules (`chain`), the provider-format view
//! `prefilter_llm_history` edits (`llm`), and the runtime's `ThreadState` (`thread`).
//!
//! Selection (reference §4): required `before_parent` hooks of the enabled direct subagent
//! relationships first, then the render's `use_hooks` list when it is non-empty (the agent's
//! `hooks` otherwise), then the `after_parent` hooks — relationships in declaration order, each
//! child's requirements in its declaration order. Hidden relationships contribute; optional ones
//! only while their flag is on; grandchildren never. At rest (a sent message's row, before the
//! execution's first render matters) the base set is the agent's hooks.
//!
//! Hooks are typed references (`ThreadHook`), so the resolution errors of the reference — an
//! unknown id, a definition exporting another id, a user-scope hook where a thread hook is
//! required — cannot be written: they fail to compile. Two definitions sharing an id are
//! refused when the runtime is built, among the hooks it can see then (the agents' `hooks`
//! and `parent_hooks`, the user hooks); among those a render selects (`use_hooks`, a
//! delegate's), when a render first meets them, which fails that submission
//! (`render_failed`).

pub(crate) mod chain;
pub(crate) mod llm;
pub(crate) mod thread;
pub(crate) mod user;

pub use user::{USER_HOOK_QUEUE, UserEvent};

pub use flue_core::lifecycle::*;

use flue_core::agent::{AgentDefinition, HookStage};
use flue_core::subagent::Subagent;

/// The result hooks see for a tool outcome: its text as `result` or `error`.
pub(crate) fn tool_result_of(text: &str, is_error: bool) -> ToolResult {
    if is_error {
        ToolResult::error(text)
    } else {
        ToolResult::success(text)
    }
}

/// The stored text and error flag of a result hooks returned: the result text on success,
/// the error text on an error (each falling back to the other, then to nothing).
pub(crate) fn outcome_of(result: &ToolResult) -> (String, bool) {
    let is_error = result.status == ToolStatus::Error;
    let (first, second) = if is_error {
        (&result.error, &result.result)
    } else {
        (&result.result, &result.error)
    };
    (first.clone().or_else(|| second.clone()).unwrap_or_default(), is_error)
}

/// The lifecycle hooks that run at one point of execution, in run order (all kinds; each
/// chain takes those of its kind).
#[derive(Clone, Default, Debug)]
pub(crate) struct HookSet {
    hooks: Vec<ThreadHook>,
}

/// What a hook id stands for in the application (see [`HookSet::register`]).
#[derive(Clone, Copy)]
pub(crate) enum KnownHook {
    /// A thread hook: the same one may be selected again.
    Thread(ThreadHook),
    /// A user-scope hook (of its kind): no thread hook may have its id.
    User(flue_core::lifecycle::HookKind),
}

impl HookSet {
    /// Checks this set's hooks against every hook `known` under their ids, and records those
    /// met for the first time (none when the set is refused): reference item 3 refuses two
    /// hooks under one id anywhere in the application, and the builder sees only the hooks
    /// agents declare, not those a render selects (one agent's selection may share an id with
    /// another agent's hook, or a user hook's). Two hooks that only renders select are told
    /// apart in the order the process meets them: the one a render meets first is the id's.
    pub(crate) fn register(
        &self,
        known: &std::sync::Mutex<std::collections::HashMap<&'static str, KnownHook>>,
    ) -> Result<(), String> {
        if self.hooks.is_empty() {
            return Ok(());
        }
        let mut known = known.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        // Checked whole before any is recorded: a refused set leaves nothing behind.
        for hook in &self.hooks {
            match known.get(hook.id()).copied() {
                None => {}
                Some(KnownHook::Thread(first)) if first == *hook => {}
                Some(KnownHook::Thread(first)) => {
                    return Err(flue_core::lifecycle::shared_id_message(
                        hook.id(),
                        first.kind(),
                        hook.kind(),
                    ));
                }
                Some(KnownHook::User(kind)) => {
                    return Err(flue_core::lifecycle::shared_id_message(hook.id(), kind, hook.kind()));
                }
            }
        }
        for hook in &self.hooks {
            known.entry(hook.id()).or_insert(KnownHook::Thread(*hook));
        }
        Ok(())
    }

    /// The set of a render: `selected` (its `use_hooks`) when non-empty, else the agent's
    /// hooks, between the required hooks of its enabled subagent relationships. A hook met
    /// twice (the agent's own that a delegate requires too, one two delegates require) runs
    /// once, at its first place: every hook is selected once, as everywhere else. Refused when
    /// two different hooks in it share an id: the builder sees only the hooks its agents
    /// declare, not the ones a render selects or a delegate it declares requires.
    pub(crate) fn resolve(
        definition: &AgentDefinition,
        selected: &[ThreadHook],
        subagents: &[Subagent],
    ) -> Result<Self, String> {
        let set = Self::resolve_with(definition, selected, subagents, |name| std::env::var(name).ok());
        for (index, hook) in set.hooks.iter().enumerate() {
            if let Some(other) = set.hooks[..index]
                .iter()
                .find(|other| other.id() == hook.id() && *other != hook)
            {
                return Err(flue_core::lifecycle::shared_id_message(
                    hook.id(),
                    other.kind(),
                    hook.kind(),
                ));
            }
        }
        Ok(set)
    }

    /// The at-rest set: the agent's hooks between the required hooks of `subagents`.
    pub(crate) fn at_rest(definition: &AgentDefinition, subagents: &[Subagent]) -> Result<Self, String> {
        Self::resolve(definition, &[], subagents)
    }

    /// [`HookSet::resolve`] with `env` answering the optional relationships' flags.
    pub(crate) fn resolve_with(
        definition: &AgentDefinition,
        selected: &[ThreadHook],
        subagents: &[Subagent],
        env: impl Fn(&str) -> Option<String>,
    ) -> Self {
        let base: &[ThreadHook] = if selected.is_empty() {
            &definition.hooks
        } else {
            selected
        };
        let enabled: Vec<&Subagent> = subagents.iter().filter(|subagent| subagent.is_enabled(&env)).collect();
        if enabled.is_empty() {
            return Self { hooks: base.to_vec() };
        }
        let required = |stage: HookStage| {
            enabled.iter().flat_map(move |subagent| {
                let child = subagent.agent().get().definition();
                child
                    .parent_hooks
                    .iter()
                    .filter(move |requirement| requirement.stage == stage)
                    .map(|requirement| requirement.hook)
                    .collect::<Vec<_>>()
            })
        };
        let mut hooks: Vec<ThreadHook> = Vec::with_capacity(base.len() + 2);
        for hook in required(HookStage::BeforeParent)
            .chain(base.iter().copied())
            .chain(required(HookStage::AfterParent))
        {
            if !hooks.contains(&hook) {
                hooks.push(hook);
            }
        }
        Self { hooks }
    }

    /// Whether any hook of `kind` is selected.
    pub(crate) fn has(&self, kind: HookKind) -> bool {
        self.hooks.iter().any(|hook| hook.kind() == kind)
    }

    /// Whether no hook is selected.
    pub(crate) fn is_empty(&self) -> bool {
        self.hooks.is_empty()
    }

    /// The selected hooks, in run order.
    #[cfg(test)]
    pub(crate) fn hooks(&self) -> &[ThreadHook] {
        &self.hooks
    }

    /// The hooks of one kind, in run order, with their ids.
    fn handlers(&self, kind: HookKind) -> impl Iterator<Item = (&'static str, ThreadHookHandler)> + '_ {
        self.hooks
            .iter()
            .filter(move |hook| hook.kind() == kind)
            .map(|hook| (hook.id(), hook.handler()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use flue_core::agent::{AgentDefinition, FnAgent, Instruction, ParentHookRequirement};
    use flue_core::lifecycle::{HookFuture, ThreadHookDefinition, ThreadState};

    fn noop(_: &ThreadState) -> HookFuture<'_, ()> {
        Box::pin(async { Ok(()) })
    }

    macro_rules! hook {
        ($name:ident, $id:literal) => {
            static $name: ThreadHookDefinition = ThreadHookDefinition {
                id: $id,
                handler: ThreadHookHandler::AfterThreadCreated(noop),
            };
        };
    }
    hook!(BASE, "base");
    hook!(SELECTED, "selected");
    hook!(CHILD_BEFORE, "child_before");
    hook!(CHILD_AFTER, "child_after");
    hook!(GRANDCHILD, "grandchild");

    fn ids(set: &HookSet) -> Vec<&'static str> {
        set.hooks().iter().map(ThreadHook::id).collect()
    }

    fn blank(_: flue_core::AgentProps<'_>) -> Instruction {
        Instruction::NONE
    }

    type Body = fn(flue_core::AgentProps<'_>) -> Instruction;

    /// An exposed agent (only one may require hooks of its parents) with `requirements`.
    fn child(name: &'static str, requirements: Vec<ParentHookRequirement>) -> FnAgent<Body> {
        FnAgent::new(
            AgentDefinition::new(name).expose_as_tool().parent_hooks(requirements),
            blank as Body,
        )
    }

    fn requirement(hook: &'static ThreadHookDefinition, stage: HookStage) -> ParentHookRequirement {
        ParentHookRequirement {
            hook: ThreadHook::new(hook),
            stage,
            reason: "because",
        }
    }

    fn parent() -> AgentDefinition {
        AgentDefinition::new("parent").hooks(vec![ThreadHook::new(&BASE)])
    }

    #[test]
    fn a_non_empty_render_selection_replaces_the_agent_hooks_and_an_empty_one_falls_back() {
        let definition = parent();
        assert_eq!(ids(&HookSet::resolve_with(&definition, &[], &[], |_| None)), ["base"]);
        let selected = [ThreadHook::new(&SELECTED)];
        assert_eq!(
            ids(&HookSet::resolve_with(&definition, &selected, &[], |_| None)),
            ["selected"]
        );
    }

    #[test]
    fn required_child_hooks_surround_the_base_set_and_hidden_relationships_contribute() {
        let child = child(
            "child",
            vec![
                requirement(&CHILD_AFTER, HookStage::AfterParent),
                requirement(&CHILD_BEFORE, HookStage::BeforeParent),
            ],
        );
        let subagents = [Subagent::new("helper", "helps", child).hidden()];
        let set = HookSet::resolve_with(&parent(), &[], &subagents, |_| None);
        assert_eq!(ids(&set), ["child_before", "base", "child_after"]);
    }

    #[test]
    fn a_required_hook_under_the_id_of_another_hook_of_the_set_is_refused() {
        // Another definition under the id `base` (the agent's own hook).
        static IMPOSTOR: ThreadHookDefinition = ThreadHookDefinition {
            id: "base",
            handler: ThreadHookHandler::AfterThreadCreated(noop),
        };
        let clashing = child("child", vec![requirement(&IMPOSTOR, HookStage::AfterParent)]);
        let subagents = [Subagent::new("helper", "helps", clashing)];
        assert_eq!(
            HookSet::resolve(&parent(), &[], &subagents)
                .map(|set| ids(&set))
                .expect_err("a required hook under a taken id"),
            "[flue] Two lifecycle hooks share the id \"base\" (after_thread_created and after_thread_created); hook ids must be unique across the application."
        );
        // The same hook twice is no clash.
        let same = child("same", vec![requirement(&BASE, HookStage::AfterParent)]);
        let subagents = [Subagent::new("helper", "helps", same)];
        assert!(HookSet::resolve(&parent(), &[], &subagents).is_ok());
    }

    #[test]
    fn an_optional_relationship_contributes_only_while_its_flag_is_on() {
        let child = child("child", vec![requirement(&CHILD_AFTER, HookStage::AfterParent)]);
        let subagents = [Subagent::new("helper", "helps", child).optional("HELPER_ON")];
        let off = HookSet::resolve_with(&parent(), &[], &subagents, |_| None);
        assert_eq!(ids(&off), ["base"]);
        for on in ["true", " YES ", "1"] {
            let set = HookSet::resolve_with(&parent(), &[], &subagents, |_| Some(on.to_owned()));
            assert_eq!(ids(&set), ["base", "child_after"], "flag {on:?}");
        }
    }

    #[test]
    fn a_grandchild_requirement_does_not_reach_the_grandparent() {
        // The middle agent delegates to a grandchild that requires a hook on its parent: the
        // middle agent's parent does not get it (only direct children's requirements count).
        fn middle_body(_: flue_core::AgentProps<'_>) -> Instruction {
            flue_core::hooks::use_subagent(Subagent::new(
                "deeper",
                "goes deeper",
                child("grandchild", vec![requirement(&GRANDCHILD, HookStage::AfterParent)]),
            ));
            Instruction::NONE
        }
        let middle = FnAgent::new(AgentDefinition::new("middle"), middle_body as Body);
        let rendered = flue_core::render_bare(&middle).expect("renders");
        assert_eq!(rendered.subagents.len(), 1, "the middle agent does delegate");
        let subagents = [Subagent::new("middle", "in between", middle)];
        assert_eq!(
            ids(&HookSet::resolve_with(&parent(), &[], &subagents, |_| None)),
            ["base"]
        );
    }

    #[test]
    fn required_hooks_follow_relationship_then_declaration_order_and_run_with_a_non_empty_selection() {
        let first = child(
            "first",
            vec![
                requirement(&CHILD_AFTER, HookStage::AfterParent),
                requirement(&GRANDCHILD, HookStage::AfterParent),
            ],
        );
        let second = child("second", vec![requirement(&CHILD_BEFORE, HookStage::AfterParent)]);
        let subagents = [
            Subagent::new("one", "first", first),
            Subagent::new("two", "second", second),
        ];
        let selected = [ThreadHook::new(&SELECTED)];
        let set = HookSet::resolve_with(&parent(), &selected, &subagents, |_| None);
        assert_eq!(ids(&set), ["selected", "child_after", "grandchild", "child_before"]);
    }

    #[test]
    fn a_hook_met_twice_in_the_set_runs_once_at_its_first_place() {
        // Required before the parent by one delegate, after it by another, and the agent's own:
        // `base` stays before the parent's set; `child_after`, required by both, once.
        let first = child(
            "first",
            vec![
                requirement(&BASE, HookStage::BeforeParent),
                requirement(&CHILD_AFTER, HookStage::AfterParent),
            ],
        );
        let second = child("second", vec![requirement(&CHILD_AFTER, HookStage::AfterParent)]);
        let subagents = [
            Subagent::new("one", "first", first),
            Subagent::new("two", "second", second),
            // The same delegate under a second name (reference Δ6).
            Subagent::new(
                "again",
                "second again",
                child("second", vec![requirement(&CHILD_AFTER, HookStage::AfterParent)]),
            ),
        ];
        let set = HookSet::resolve_with(&parent(), &[], &subagents, |_| None);
        assert_eq!(ids(&set), ["base", "child_after"]);
    }
}
