/// Finds duplicate GitHub issues.
#[allow(non_camel_case_types)]
#[derive(
    ::core::clone::Clone,
    ::core::marker::Copy,
    ::core::fmt::Debug,
    ::core::default::Default,
)]
struct duplicate_finder;
const _: () = {
    use ::flue_runtime::__private::flue_core as __flue;
    fn __flue_definition_of() -> __flue::AgentDefinition {
        #[allow(unused_mut)]
        let mut __flue_definition = __flue::AgentDefinition::from_checked(
            ::std::borrow::Cow::Borrowed("duplicate_finder"),
        );
        __flue_definition = __flue_definition
            .description("Finds duplicate GitHub issues.");
        __flue_definition = __flue_definition.max_steps(6);
        __flue_definition = __flue_definition
            .hooks(::std::vec![__flue::lifecycle::thread_hook(redact_emails)]);
        __flue_definition
    }
    #[allow(deprecated)]
    type __FlueAgent = duplicate_finder;
    #[automatically_derived]
    impl __flue::Agent for __FlueAgent {
        fn definition(&self) -> &__flue::AgentDefinition {
            static DEFINITION: ::std::sync::OnceLock<__flue::AgentDefinition> = ::std::sync::OnceLock::new();
            DEFINITION.get_or_init(__flue_definition_of)
        }
        #[track_caller]
        fn render_body(
            &self,
            __flue_props: __flue::AgentProps<'_>,
        ) -> __flue::Instruction {
            let __flue_body = __flue::render::BodyGuard::enter();
            #[allow(dead_code)]
            fn __flue_agent_body() -> &'static str {
                use_model("openrouter/anthropic/claude-sonnet-4.5");
                use_tool(get_github_issue);
                "You check whether a GitHub issue duplicates an older open issue."
            }
            {
                use __flue::agent::{Instructs as _, NotInstructs as _};
                let __flue_returned = __flue_agent_body();
                (&__flue::agent::ReturnedValue(&__flue_returned))
                    .__flue_instruction()
                    .convert(__flue_returned)
            }
        }
    }
};
